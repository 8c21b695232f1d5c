"""Where a context's first audio spends its time, across the gateway and the engine process (a device tool).

Put this folder first on PYTHONPATH and set VOXGATE_TRACE_DIR before `voxgate serve`: as the server (and its spawned
engine process) import their modules, a few methods are wrapped to write JSON lines of `time.monotonic()` stamps
(one clock for every process of the machine) to `VOXGATE_TRACE_DIR/trace-PID.jsonl`. Nothing changes without the
variable. `burst_report.py` reads them. Kinds:
- gateway: `gw_submit` (a request sent to the engine), `gw_read` (its first audio read from the pipe),
  `gw_dispatch` (handed to its context on the event loop), `gw_taken` (taken by the context's sending task),
  `gw_encoded` (its frames back from the audio encoder), `gw_sent` (a context's first audio sent, with its first
  request's id; `since`: when its text started speaking, the start of its server TTFA);
- engine process: `en_cmd` (the submit applied; `eid`: the engine's id), `en_pub` (its first audio published),
  `en_step` (one step: its wall time, batch, admitted ids, and the seconds in admission, frame launch, the wait for
  the codes, postprocess, decode queueing, collection and publishing).
It wraps private methods: it is a measuring aid for one revision at a time, not an API.
"""
import importlib.abc
import json
import os
import sys
import threading
import time

DIRECTORY = os.environ.get("VOXGATE_TRACE_DIR")
_lock = threading.Lock()
_file = None
_step: dict = {}  # the step in progress (engine process): its timings so far


def emit(kind: str, **fields) -> None:
    global _file
    with _lock:
        if _file is None:
            os.makedirs(DIRECTORY, exist_ok=True)
            _file = open(os.path.join(DIRECTORY, f"trace-{os.getpid()}.jsonl"), "a", buffering=1)
        fields["k"], fields["t"] = kind, time.monotonic()
        _file.write(json.dumps(fields) + "\n")


def first_audio(kind: str, seen: set, request_id: int | None) -> None:
    if request_id is not None and request_id not in seen:
        seen.add(request_id)
        emit(kind, rid=request_id)


def add_time(name: str, since: float) -> None:
    if _step:
        _step[name] = _step.get(name, 0.0) + time.monotonic() - since


def timed(name: str, method):
    def run(*args, **kwargs):
        started = time.monotonic()
        try:
            return method(*args, **kwargs)
        finally:
            add_time(name, started)
    return run


def trace_front_end(module) -> None:
    front_end = module.FrontEnd
    submit, deliver = front_end.submit, front_end._deliver
    dispatched = set()

    def traced_submit(self, request):
        handle = submit(self, request)
        emit("gw_submit", rid=handle.request_id, interactive=request.interactive)
        return handle

    def traced_deliver(self, events):
        for event in events:
            if type(event).__name__ == "AudioChunk":
                first_audio("gw_dispatch", dispatched, event.request_id)
        return deliver(self, events)

    front_end.submit, front_end._deliver = traced_submit, traced_deliver


def trace_process_engine(module) -> None:
    reader = module.MessageReader
    feed = reader.feed
    read = set()

    def traced_feed(self):
        messages = feed(self)
        for kind, *args in messages:
            for event in args[0] if kind == "publish" else ():
                if type(event).__name__ == "AudioChunk":
                    first_audio("gw_read", read, event.request_id)
        return messages

    reader.feed = traced_feed


def trace_contexts(module) -> None:
    context = module.SessionContext
    first_sent = context._first_sent

    def traced_first_sent(self):
        first_sent(self)
        request = self.speech._request  # the request of the utterance being spoken: the context's first
        emit("gw_sent", since=self.stats.since(self.speech.planner),
             rid=request.request_id if request is not None else None)

    send_audio, queue_frames = context._send_audio, context._queue_frames
    taken, encoded = set(), set()

    def request_id(self):
        request = self.speech._request  # the request of the utterance being spoken
        return request.request_id if request is not None else None

    async def traced_send_audio(self, audio):
        first_audio("gw_taken", taken, request_id(self))
        return await send_audio(self, audio)

    def traced_queue_frames(self, frames, last):
        if frames:
            first_audio("gw_encoded", encoded, request_id(self))
        return queue_frames(self, frames, last)

    context._first_sent = traced_first_sent
    context._send_audio, context._queue_frames = traced_send_audio, traced_queue_frames


def trace_step_loop(module) -> None:
    loop = module.StepLoop
    submit, publish = loop._submit, loop._publish
    published = set()

    def traced_submit(self, request_id, request):
        submit(self, request_id, request)
        emit("en_cmd", rid=request_id, eid=self._engine_ids.get(request_id))

    def traced_publish(self, events):
        for event in events:
            if type(event).__name__ == "AudioChunk":
                first_audio("en_pub", published, self._request_ids.get(event.request_id))
        started = time.monotonic()
        publish(self, events)
        add_time("publish", started)

    loop._submit, loop._publish = traced_submit, traced_publish


def trace_engine(module) -> None:
    engine = module.Engine
    step, admit = engine.step, engine._admit

    def traced_admit(self):
        before = set(self.running)
        admit(self)
        _step["ids"] = [request_id for request_id in self.running if request_id not in before]

    def traced_step(self, on_audio=None):
        _step.update(batch=len(self.running), waiting=len(self.waiting))
        started = time.monotonic()
        try:
            return step(self, on_audio)
        finally:
            _step["wall"] = time.monotonic() - started
            emit("en_step", **_step)
            _step.clear()

    engine.step, engine._admit = traced_step, timed("admit", traced_admit)
    engine._frames, engine._collect = timed("frames", engine._frames), timed("collect", engine._collect)
    decoding = sys.modules["engine.core.decoding"].Decoding
    decoding.queue = timed("queue", decoding.queue)
    scheduler = sys.modules["engine.core.scheduler"].Scheduler
    scheduler.postprocess = timed("post", scheduler.postprocess)
    codes = sys.modules["engine.core.step_batch"].StepCodes
    codes.host = timed("host", codes.host)  # the wait for the frame on the GPU


TRACED = {"engine.serving.async_engine": trace_front_end, "engine.serving.process_engine": trace_process_engine,
          "realtime.ws.contexts": trace_contexts,
          "engine.serving.step_loop": trace_step_loop, "engine.core.engine": trace_engine}


class _Finder(importlib.abc.MetaPathFinder):
    """Finds the traced modules as the other finders do, and wraps each once it has run."""

    def find_spec(self, name, path, target=None):
        if name not in TRACED:
            return None
        for finder in sys.meta_path:
            if finder is not self and (spec := finder.find_spec(name, path, target)) is not None:
                break
        else:
            return None
        execute = spec.loader.exec_module

        def exec_module(module):
            execute(module)
            TRACED[name](module)
        spec.loader.exec_module = exec_module
        return spec


if DIRECTORY:
    sys.meta_path.insert(0, _Finder())
