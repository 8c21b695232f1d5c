"""Load generator for a voxgate server, end to end. Closed loop (the default): N concurrent sessions, each speaking
contexts one after another whose text arrives like an LLM's answer (first token after 100-300 ms, then LOW-HIGH
tokens/s in pieces of 1-4 words), for a fixed duration. Prints one JSON report: client-side TTFA (from the first
append), the server's own `ttfa_ms`, the share of contexts that never underran in a simulated player, where a
context's time went, and errors by code. By default a session's next context starts at once (a stress load that takes
all the server gives); `--listen` makes each session play its audio and wait for its user first, as a voice chat
does. `--processes P` spreads the sessions over P client processes: one Python process reads ~10,000 audio messages
a second at most, so past ~64 sessions a single one falls behind and the server closes its sessions as slow
consumers.

Open loop (`--mode open`): requests arrive at Poisson times (`--rate` per second for `--duration` s), each its own
task, whatever the others are doing: `--traffic http` streams `POST /v1/audio/speech` as raw PCM (what nari-labs'
tts_bench sends), `--traffic ws` opens a session per arrival and speaks one context whose text is a prompt's words at
LLM pace. Prompts come from `--prompts` (scripts/prompts/english_1k.jsonl). It reports audible TTFA, underruns of a
player that starts at the first audio, E2E, peak in-flight, audio seconds per wall second and the server process's
CPU: a table on stderr, one JSON line on stdout (docs/benchmarks.md, "Open loop", defines each).

`--serve` starts a server in this process (the embedded tiny model unless `--model`); its event loop runs in a
thread beside the load generator's, so on a small CPU the two compete: use a separate server for real numbers.
    python scripts/bench_gateway.py --serve --sessions 4 --duration 20
    python scripts/bench_gateway.py --url ws://HOST:8000/v1/tts/stream --api-key KEY --sessions 40 --token-rate 5-10
    python scripts/bench_gateway.py --url ws://HOST:8000/v1/tts/stream --sessions 256 --processes 8
    python scripts/bench_gateway.py --url ws://HOST:8000/v1/tts/stream --mode open --traffic http --rate 10
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import re
import sys
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from multiprocessing import get_context
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import httpx
import numpy as np
from websockets.exceptions import ConnectionClosed

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.core.simulator import llm_token_times, poisson_times  # noqa: E402
from voxgate_client.client import ContextResult, ServerError, VoxgateClient, context_audio  # noqa: E402

WORDS = ("the quick brown fox jumps over a lazy dog while music plays softly in the old town hall tonight "
         "and everyone listens to the story about rivers mountains and distant cities").split()
PREBUFFER_S = 0.1  # the closed loop's second playback: a client that buffers this much before it plays (issue 17)
USER_TURN_S = (1.0, 3.0)  # `--listen`: how long the user takes to answer, after the audio has played
PHASES = ("text_s", "audio_arrival_span_s", "done_after_audio_s", "context_s")


def llm_answer(rng: random.Random, token_rate: tuple[float, float]) -> list[tuple[float, str]]:
    """(seconds after the request, text) of each piece of an answer of 8-40 words, a comma every seven."""
    words = [rng.choice(WORDS) for _ in range(rng.randint(8, 40))]
    tokens = [(" " if i else "") + word + ("," if i % 7 == 6 else "") for i, word in enumerate(words)]
    tokens[-1] = tokens[-1].rstrip(",") + "."
    return llm_pieces(rng, tokens, token_rate)


def llm_pieces(rng: random.Random, tokens: list[str], token_rate: tuple[float, float]) -> list[tuple[float, str]]:
    """(seconds after the request, text) of the tokens as an LLM sends them: the first after 100-300 ms, then at a
    rate drawn from `token_rate` (tokens/s), in pieces of 1-4 tokens."""
    pieces: list[tuple[float, str]] = []
    for at, token in zip(llm_token_times(rng, 0.0, len(tokens), rng.uniform(*token_rate)), tokens):
        if pieces and pieces[-1][0] == at:  # tokens of one piece share their arrival time
            pieces[-1] = (at, pieces[-1][1] + token)
        else:
            pieces.append((at, token))
    return pieces


async def paced(pieces: list[tuple[float, str]]) -> AsyncIterator[str]:
    start = time.monotonic()
    for at, text in pieces:
        await asyncio.sleep(max(0.0, start + at - time.monotonic()))
        yield text


@dataclass(frozen=True)
class Playback:
    """A player that starts at the first audio received and plays in real time: whenever the next audio has not
    arrived by the moment the playhead reaches it, playback stalls (an underrun) until it arrives."""
    start: float  # wall time of the first audio
    chunks: tuple[tuple[float, float], ...]  # (arrival, seconds of audio), in stream order
    gaps: tuple[float, ...]  # each stall's length, seconds

    def wall_time(self, media_s: float) -> float:
        """When the player plays the audio `media_s` seconds into the stream (stalls before it included)."""
        playhead, media = self.start, 0.0
        for arrival, seconds in self.chunks:
            playhead = max(playhead, arrival)
            if media_s < media + seconds:
                break
            playhead += seconds
            media += seconds
        return playhead + media_s - media


def playback(chunks: list[tuple[float, float]], prebuffer_s: float = 0.0) -> Playback | None:
    """The playback of chunks of audio (arrival time, seconds), as tts_bench's immediate-playback client plays
    them, or (`prebuffer_s`) as a client that starts playing that long after the first audio arrived; None when no
    audio arrived."""
    if not chunks:
        return None
    playhead, gaps = chunks[0][0] + prebuffer_s, []
    for arrival, seconds in chunks:
        if arrival > playhead:
            gaps.append(arrival - playhead)
            playhead = arrival
        playhead += seconds
    return Playback(chunks[0][0], tuple(chunks), tuple(gaps))


def played_until(result: ContextResult, sample_rate: int) -> float:
    """When a client that buffers PREBUFFER_S before it plays has played the context's last audio (its stalls
    included); now, for a context without audio."""
    total = round(result.done["audio_ms"] / 1000 * sample_rate) if result.done else 0
    played = playback(context_chunks(result, sample_rate, total), PREBUFFER_S)
    if played is None:
        return time.monotonic()
    return played.start + PREBUFFER_S + sum(seconds for _, seconds in played.chunks) + sum(played.gaps)


def context_chunks(result: ContextResult, sample_rate: int, total_samples: int) -> list[tuple[float, float]]:
    """(arrival, seconds) of a context's frames that carry audio: each lasts until the next frame's pts, the last
    until `total_samples` (the decoded length; 0 when not decoded: the last frame is then checked for lateness
    only)."""
    frames = [(frame.pts, at) for frame, at in zip(result.frames, result.arrivals) if frame.payload]
    ends = [pts for pts, _ in frames[1:]] + [max(total_samples, frames[-1][0] if frames else 0)]
    return [(at, (end - pts) / sample_rate) for (pts, at), end in zip(frames, ends)]


@dataclass
class Stats:
    contexts: int = 0
    done: int = 0
    audio_s: float = 0.0
    client_ttfa_s: list[float] = field(default_factory=list)
    server_ttfa_ms: list[float] = field(default_factory=list)
    server_ttfa_later_ms: list[float] = field(default_factory=list)  # each session's contexts after its first
    smooth: list[bool] = field(default_factory=list)
    smooth_prebuffered: list[bool] = field(default_factory=list)  # behind PREBUFFER_S of client buffer
    errors: Counter = field(default_factory=Counter)
    # sessions still running --drain-s after the duration (cancelled then): what each was doing, and since when
    stuck: list[dict] = field(default_factory=list)
    # where a context's time goes at the client, seconds: its text's pacing, the spread of its audio's arrivals, the
    # wait from its last audio to context.done, and the whole of it (first append to context.done)
    phases: dict[str, list[float]] = field(default_factory=lambda: {k: [] for k in PHASES})

    def add(self, result: ContextResult, sample_rate: int, text_s: float = 0.0, returned_at: float = 0.0,
            later: bool = False) -> None:
        """`later`: not its session's first context (all sessions start theirs at once: a burst)."""
        self.contexts += 1
        if result.arrivals and result.started_at is not None and returned_at:
            for name, value in zip(PHASES, (text_s, result.arrivals[-1] - result.arrivals[0],
                                            returned_at - result.arrivals[-1], returned_at - result.started_at)):
                self.phases[name].append(value)
        self.errors.update(e.get("code", "?") for e in result.errors)
        if result.ttfa_s is not None:
            self.client_ttfa_s.append(result.ttfa_s)
            chunks = context_chunks(result, sample_rate, 0)
            for smooth, prebuffer_s in ((self.smooth, 0.0), (self.smooth_prebuffered, PREBUFFER_S)):
                played = playback(chunks, prebuffer_s)
                smooth.append(played is None or not played.gaps)
        if result.done is not None:
            self.done += 1
            self.audio_s += result.done["audio_ms"] / 1000
            if (ttfa_ms := result.done["metrics"].get("ttfa_ms")) is not None:
                self.server_ttfa_ms.append(ttfa_ms)
                if later:
                    self.server_ttfa_later_ms.append(ttfa_ms)

    def merge(self, other: Stats) -> None:
        """Another client process's share, added to this one."""
        self.contexts += other.contexts
        self.done += other.done
        self.audio_s += other.audio_s
        self.client_ttfa_s += other.client_ttfa_s
        self.server_ttfa_ms += other.server_ttfa_ms
        self.server_ttfa_later_ms += other.server_ttfa_later_ms
        self.smooth += other.smooth
        self.smooth_prebuffered += other.smooth_prebuffered
        self.errors.update(other.errors)
        self.stuck += other.stuck
        for name, values in other.phases.items():
            self.phases[name] += values


async def count_session_errors(client: VoxgateClient, errors: Counter) -> None:
    """Errors that belong to no running context (a context's own errors are counted from its result)."""
    async for item in client.events():
        if isinstance(item, dict) and item.get("type") == "error":
            errors[item.get("code", "?")] += 1


async def run_session(index: int, args: argparse.Namespace, deadline: float, stats: Stats,
                      doing: dict[int, tuple[str, float]]) -> None:
    """`doing[index]`: what the session is doing now and since when (a stuck session's report says it)."""
    rng = random.Random(args.seed * 100_003 + index)
    doing[index] = ("connecting", time.monotonic())
    try:
        async with VoxgateClient.connect(args.url, api_key=args.api_key, encoding=args.encoding) as client:
            watcher = asyncio.create_task(count_session_errors(client, stats.errors))
            if args.buffering != "auto":
                await client.start(text={"buffering": args.buffering})
            rate = client.session["audio"]["sample_rate"]
            count = 0
            while time.monotonic() < deadline and client.close_code is None:
                answer = llm_answer(rng, args.token_rate)
                doing[index] = (f"speaking s{index}-c{count}", time.monotonic())
                result = await client.speak(f"s{index}-c{count}", paced(answer))
                stats.add(result, rate, answer[-1][0] - answer[0][0], time.monotonic(), later=count > 0)
                count += 1
                if any(e.get("fatal") for e in result.errors):  # the server is closing this session
                    break
                if args.listen and time.monotonic() < deadline:
                    doing[index] = ("listening", time.monotonic())
                    await asyncio.sleep(max(0.0, played_until(result, rate) - time.monotonic())
                                        + rng.uniform(*USER_TURN_S))
            doing[index] = ("closing", time.monotonic())
            await client.close()
            await watcher
    except ServerError as failure:  # refused (overloaded, unauthorized) or closed under us
        stats.errors[failure.code] += 1
    except (ConnectionClosed, OSError) as failure:
        stats.errors[f"connection: {type(failure).__name__}"] += 1


def percentiles(values: list[float], scale: float = 1.0) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p95": None, "p99": None}
    array = np.asarray(values) * scale
    return {f"p{q}": round(float(np.percentile(array, q)), 1) for q in (50, 95, 99)}


async def run_sessions(args: argparse.Namespace, indices: range) -> tuple[Stats, float]:
    """These sessions for --duration from now: their stats and the wall time they took."""
    stats, doing = Stats(), {}
    if not indices:  # more client processes than sessions: this one has none
        return stats, 0.0
    started = time.monotonic()
    deadline = started + args.duration
    tasks = {asyncio.create_task(run_session(i, args, deadline, stats, doing)): i for i in indices}
    _, pending = await asyncio.wait(tasks, timeout=args.duration + args.drain_s)
    now = time.monotonic()
    for task in pending:  # a context that never ended, a close never answered: reported, not waited for forever
        task.cancel()
        what, since = doing[tasks[task]]
        stats.stuck.append({"session": tasks[task], "doing": what, "for_s": round(now - since, 1)})
    await asyncio.gather(*pending, return_exceptions=True)
    return stats, now - started


def client_process(args: argparse.Namespace, indices: range) -> tuple[Stats, float]:
    """One client process's share of the sessions, timed from its own start (processes start a few s apart)."""
    return asyncio.run(run_sessions(args, indices))


async def bench(args: argparse.Namespace, server_pid: int | None) -> dict:
    cpu_first = cpu_times(server_pid) if server_pid else None
    if args.processes == 1:
        stats, wall = await run_sessions(args, range(args.sessions))
    else:
        loop = asyncio.get_running_loop()
        with ProcessPoolExecutor(args.processes, mp_context=get_context("spawn")) as pool:
            shares = await asyncio.gather(*(
                loop.run_in_executor(pool, client_process, args, range(first, args.sessions, args.processes))
                for first in range(args.processes)))
        stats, wall = Stats(), max(share_wall for _, share_wall in shares)
        for share, _ in shares:
            stats.merge(share)
    cpu_last = cpu_times(server_pid) if server_pid else None
    return {"url": args.url, "sessions": args.sessions, "processes": args.processes, "duration_s": args.duration,
            "wall_s": round(wall, 1), "encoding": args.encoding, "buffering": args.buffering,
            "token_rate": list(args.token_rate), "listen": args.listen, "contexts": stats.contexts,
            "contexts_done": stats.done,
            "audio_s": round(stats.audio_s, 1), "audio_s_per_wall_s": round(stats.audio_s / wall, 2),
            "ttfa_client_ms": percentiles(stats.client_ttfa_s, 1000.0),
            "ttfa_server_ms": percentiles(stats.server_ttfa_ms),
            "ttfa_server_later_ms": percentiles(stats.server_ttfa_later_ms),
            "never_underrun": fraction(stats.smooth),
            f"never_underrun_behind_{round(PREBUFFER_S * 1000)}ms": fraction(stats.smooth_prebuffered),
            "context_phases_ms": {name: percentiles(values, 1000.0) for name, values in stats.phases.items()},
            "errors": dict(stats.errors), "stuck_sessions": len(stats.stuck), "stuck": stats.stuck[:10],
            "server_cpu": cpu_report(server_pid, cpu_first, cpu_last, stats.audio_s)}


def fraction(flags: list[bool]) -> float | None:
    return round(sum(flags) / len(flags), 3) if flags else None


# --- open loop: Poisson arrivals, each request on its own, never waiting for another -------------------------------

PROMPTS = Path(__file__).resolve().parent / "prompts" / "english_1k.jsonl"
# tts_bench's AudibleOnsetDetector (v1): 20 ms windows every 10 ms, DC removed, RMS >= -45 dBFS in two in a row
ONSET_WINDOW_S, ONSET_HOP_S, ONSET_DBFS = 0.020, 0.010, -45.0


def audible_onset(samples: np.ndarray, sample_rate: int) -> float | None:
    """Seconds into the audio (float samples in [-1, 1]) where sound starts, as tts_bench finds it: the start of the
    first two consecutive windows loud enough; None when it never gets loud."""
    window, hop = round(sample_rate * ONSET_WINDOW_S), round(sample_rate * ONSET_HOP_S)
    if len(samples) < window + hop:
        return None
    frames = np.lib.stride_tricks.sliding_window_view(np.asarray(samples, np.float64), window)[::hop]
    rms = np.sqrt(np.mean((frames - frames.mean(axis=1, keepdims=True)) ** 2, axis=1))
    loud = rms >= 10 ** (ONSET_DBFS / 20)
    hits = np.flatnonzero(loud[:-1] & loud[1:])
    return float(hits[0] * hop / sample_rate) if len(hits) else None


@dataclass
class Outcome:
    """One open-loop request, on the load generator's `time.monotonic()` clock."""
    scheduled: float  # its Poisson arrival
    started: float | None = None  # when its task began (started - scheduled: the load generator's own lag)
    dispatched: float | None = None  # time zero: HTTP, the request body written; WebSocket, the first text.append
    chunks: list[tuple[float, float]] = field(default_factory=list)  # (arrival, seconds of audio)
    onset_s: float | None = None  # audible onset, seconds into its audio
    ended: float | None = None  # the response's end (HTTP) or context.done (WebSocket)
    error: str | None = None
    server_ttfa_ms: float | None = None  # WebSocket: context.done's metrics.ttfa_ms
    # the decoding and onset search of its audio, run after the load: done as each request ended, it held the load
    # generator's event loop 10-30 ms a request, late for the next arrivals and the other requests' audio
    analysis: Callable[[], None] | None = None

    def analyse(self) -> None:
        if self.analysis is not None:
            self.analysis()
            self.analysis = None


@dataclass
class InFlight:
    now: int = 0
    peak: int = 0

    def enter(self) -> None:
        self.now += 1
        self.peak = max(self.peak, self.now)

    def leave(self) -> None:
        self.now -= 1


def load_prompts(path: Path) -> list[str]:
    """The `text` of each line of a JSONL prompt set (scripts/make_prompts.py writes one)."""
    return [json.loads(line)["text"] for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def speech_url(ws_url: str) -> str:
    """`POST /v1/audio/speech` on the server of a `/v1/tts/stream` URL."""
    parts = urlsplit(ws_url)
    return urlunsplit(("https" if parts.scheme == "wss" else "http", parts.netloc, "/v1/audio/speech", "", ""))


async def http_request(client: httpx.AsyncClient, args: argparse.Namespace, text: str, outcome: Outcome) -> None:
    """One streamed PCM request, as tts_bench sends it (stream, raw 16-bit PCM, the whole text at once)."""
    async def trace(event: str, info: dict) -> None:
        if event == "http11.send_request_body.complete":
            outcome.dispatched = time.monotonic()

    body = {"input": text, "response_format": "pcm", "stream": True, "language": args.language}
    body |= {"voice": args.voice} if args.voice else {}
    async with client.stream("POST", speech_url(args.url), json=body, extensions={"trace": trace}) as response:
        if response.status_code != 200:
            await response.aread()
            outcome.error = f"http {response.status_code} {error_code(response)}"
            return
        rate = int(response.headers.get("x-sample-rate", "24000"))
        pcm = bytearray()
        async for raw in response.aiter_raw():
            arrived, before = time.monotonic(), len(pcm) // 2
            pcm += raw
            if len(pcm) // 2 > before:
                outcome.chunks.append((arrived, (len(pcm) // 2 - before) / rate))
    outcome.ended = time.monotonic()
    if len(pcm) % 2 or not pcm:
        outcome.error = "pcm: no audio" if not pcm else "pcm: a partial sample"
        return

    def analysis() -> None:
        outcome.onset_s = audible_onset(np.frombuffer(bytes(pcm), "<i2") / 32768.0, rate)

    outcome.analysis = analysis


def error_code(response: httpx.Response) -> str:
    try:
        return str(response.json()["error"]["code"])
    except (ValueError, KeyError, TypeError):
        return "?"


async def ws_request(args: argparse.Namespace, index: int, text: str, outcome: Outcome) -> None:
    """One session with one context whose text (the prompt's words) comes like an LLM's answer."""
    rng = random.Random(args.seed * 100_003 + index)
    async with VoxgateClient.connect(args.url, api_key=args.api_key, encoding=args.encoding) as client:
        if args.buffering != "auto":
            await client.start(text={"buffering": args.buffering})
        result = await client.speak("c0", paced(llm_pieces(rng, re.findall(r"\s*\S+", text), args.token_rate)))
        outcome.ended = time.monotonic()
        await client.close()
    outcome.dispatched = result.started_at
    if result.errors or result.done is None:
        outcome.error = result.errors[0].get("code", "?") if result.errors else "no context.done"
    if result.done is not None:
        outcome.server_ttfa_ms = result.done["metrics"].get("ttfa_ms")
    session = client.session

    def analysis() -> None:
        samples, rate = context_audio(result, session), session["audio"]["sample_rate"]
        outcome.chunks = context_chunks(result, rate, len(samples))
        outcome.onset_s = audible_onset(samples, rate)

    outcome.analysis = analysis


async def open_request(args: argparse.Namespace, client: httpx.AsyncClient, index: int, text: str,
                       outcome: Outcome, in_flight: InFlight) -> None:
    """A request that counts its own failure (by code) instead of raising: the run goes on."""
    outcome.started = time.monotonic()
    in_flight.enter()
    request = http_request(client, args, text, outcome) if args.traffic == "http" else ws_request(
        args, index, text, outcome)
    try:
        await asyncio.wait_for(request, args.timeout)
    except TimeoutError:
        outcome.error = "timeout"
    except ServerError as failure:  # a session refused (overloaded, unauthorized) or closed under us
        outcome.error = failure.code
    except (httpx.HTTPError, ConnectionClosed, OSError, ValueError) as failure:
        outcome.error = f"connection: {type(failure).__name__}"
    finally:
        in_flight.leave()


@dataclass(frozen=True)
class CpuTimes:
    at: float
    process_s: float  # the server process's user + system CPU seconds
    children_s: float  # its living descendants' but the encoders (the engine process on a GPU)
    encoders_s: float  # its audio encoder processes' (realtime/audio/encoder_pool.py): the gateway's work


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def descendants(pid: int) -> list[int]:
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parents[int(stat.parent.name)] = int(stat.read_text().rpartition(")")[2].split()[1])
        except (OSError, ValueError):  # a process that ended while we looked
            continue
    found, frontier = [], [pid]
    while frontier:
        children = [child for child, parent in parents.items() if parent in frontier]
        found += children
        frontier = children
    return found


def cpu_times(pid: int) -> CpuTimes:
    children = encoders = 0.0
    for child in descendants(pid):
        with contextlib.suppress(OSError):
            if b"realtime.audio.encoder_worker" in Path(f"/proc/{child}/cmdline").read_bytes():
                encoders += cpu_seconds(child)
            else:
                children += cpu_seconds(child)
    return CpuTimes(time.monotonic(), cpu_seconds(pid), children, encoders)


def listening_pid(port: int) -> int | None:
    """The process that listens on a local TCP port (the outermost one, when a child inherited the socket)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and int(fields[1].rpartition(":")[2], 16) == port:  # 0A: LISTEN
                    inodes.add(f"socket:[{fields[9]}]")
    owners = set()
    for fd in Path("/proc").glob("[0-9]*/fd/*"):
        with contextlib.suppress(OSError):
            if os.readlink(fd) in inodes:
                owners.add(int(fd.parent.parent.name))
    outermost = [pid for pid in owners if not any(pid in descendants(other) for other in owners if other != pid)]
    return min(outermost) if outermost else None


def nearest_rank(values: list[float], scale: float = 1.0) -> dict[str, float | None]:
    """p50 / p95 / p99 by nearest rank, as tts_bench reports them."""
    if not values:
        return {"p50": None, "p95": None, "p99": None}
    ordered = sorted(values)
    return {f"p{q}": round(ordered[max(0, math.ceil(q * len(ordered) / 100) - 1)] * scale, 1) for q in (50, 95, 99)}


def open_loop_report(outcomes: list[Outcome], window: tuple[float, float]) -> dict:
    """What the requests saw: audible TTFA on the playback timeline from time zero, underruns of an immediate
    player, E2E, and the audio received while arrivals were open per second of that window."""
    played = [(outcome, playback(outcome.chunks)) for outcome in outcomes if outcome.dispatched is not None]
    played = [(outcome, play) for outcome, play in played if play is not None]
    underrun = [play for _, play in played if play.gaps]
    window_audio = sum(seconds for outcome in outcomes for at, seconds in outcome.chunks if window[0] <= at < window[1])
    return {
        "requests": len(outcomes), "with_audio": len(played),
        "inaudible": sum(outcome.onset_s is None for outcome, _ in played),
        "errors": dict(Counter(outcome.error for outcome in outcomes if outcome.error)),
        "audible_ttfa_ms": nearest_rank([play.wall_time(outcome.onset_s) - outcome.dispatched
                                         for outcome, play in played if outcome.onset_s is not None], 1000.0),
        "first_audio_ms": nearest_rank([play.start - outcome.dispatched for outcome, play in played], 1000.0),
        "e2e_ms": nearest_rank([outcome.ended - outcome.dispatched for outcome in outcomes
                                if outcome.error is None and outcome.dispatched is not None], 1000.0),
        "server_ttfa_ms": nearest_rank([o.server_ttfa_ms for o in outcomes if o.server_ttfa_ms is not None]),
        "underrun_requests": len(underrun),
        "underrun_share": round(len(underrun) / len(played), 4) if played else None,
        "underrun_gap_s": round(sum(sum(play.gaps) for play in underrun), 3),
        "largest_gap_ms": round(max((max(play.gaps) for play in underrun), default=0.0) * 1000, 1),
        "audio_s_per_wall_s": round(window_audio / (window[1] - window[0]), 2),
        "start_lag_ms": nearest_rank([o.started - o.scheduled for o in outcomes if o.started is not None], 1000.0),
    }


def cpu_report(pid: int | None, first: CpuTimes | None, last: CpuTimes | None, audio_s: float | None = None) -> dict:
    """The server process's cores (the gateway: with the engine in a process of its own, that is the child's), its
    encoder processes' and its other children's; with `audio_s` (the audio received over the same span), the
    gateway's CPU milliseconds (its process and its encoders) per second of audio, which says how many cores N
    real-time streams take."""
    if pid is None or first is None or last is None:
        return {"pid": pid, "cores": None, "encoder_cores": None, "children_cores": None}
    wall, process_s = last.at - first.at, last.process_s - first.process_s
    encoders_s = last.encoders_s - first.encoders_s
    report = {"pid": pid, "cores": round(process_s / wall, 2), "encoder_cores": round(encoders_s / wall, 2),
              "children_cores": round((last.children_s - first.children_s) / wall, 2)}
    if audio_s:
        report["cpu_ms_per_audio_s"] = round(1000 * (process_s + encoders_s) / audio_s, 2)
    return report


async def open_loop(args: argparse.Namespace, server_pid: int | None) -> dict:
    """Arrivals at their Poisson times, each its own task: a slow or failed request never delays the next."""
    rng = random.Random(args.seed)
    prompts = load_prompts(args.prompts)
    order = rng.sample(prompts, len(prompts))
    arrivals = list(poisson_times(rng, args.rate, args.duration))
    outcomes, in_flight, tasks = [], InFlight(), []
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    pool = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=None, limits=pool, headers=headers) as client:
        cpu_first = cpu_times(server_pid) if server_pid else None
        start = time.monotonic()
        for index, at in enumerate(arrivals):
            await asyncio.sleep(max(0.0, start + at - time.monotonic()))
            outcomes.append(Outcome(scheduled=start + at))
            tasks.append(asyncio.create_task(
                open_request(args, client, index, order[index % len(order)], outcomes[-1], in_flight)))
        await asyncio.sleep(max(0.0, start + args.duration - time.monotonic()))
        cpu_last = cpu_times(server_pid) if server_pid else None
        await asyncio.gather(*tasks)
    for outcome in outcomes:
        outcome.analyse()
    url = speech_url(args.url) if args.traffic == "http" else args.url
    return {"mode": "open", "traffic": args.traffic, "url": url, "serve_in_process": args.serve, "rate": args.rate,
            "duration_s": args.duration, "wall_s": round(time.monotonic() - start, 1),
            "seed": args.seed, "prompts": str(args.prompts),
            **({"encoding": args.encoding, "buffering": args.buffering, "token_rate": list(args.token_rate)}
               if args.traffic == "ws" else {"voice": args.voice, "language": args.language}),
            **open_loop_report(outcomes, (start, start + args.duration)), "peak_in_flight": in_flight.peak,
            "server_cpu": cpu_report(server_pid, cpu_first, cpu_last)}


def table(report: dict) -> str:
    """The open-loop report, for a person."""
    rows = [("audible TTFA", "audible_ttfa_ms"), ("first audio", "first_audio_ms"), ("E2E", "e2e_ms"),
            ("server TTFA", "server_ttfa_ms"), ("task start lag", "start_lag_ms")]
    cpu = report["server_cpu"]
    lines = [f"open loop, {report['traffic']}, {report['rate']} req/s for {report['duration_s']} s: "
             f"{report['requests']} requests, {report['with_audio']} with audio, {report['inaudible']} never audible, "
             f"errors: {report['errors'] or 'none'}",
             f"{'ms':<16}{'p50':>10}{'p95':>10}{'p99':>10}"]
    lines += [f"{name:<16}" + "".join(f"{'-' if report[key][q] is None else report[key][q]:>10}"
                                       for q in ("p50", "p95", "p99")) for name, key in rows]
    lines += [f"underrun requests: {report['underrun_requests']} ({report['underrun_share']}), total gap "
              f"{report['underrun_gap_s']} s, largest {report['largest_gap_ms']} ms",
              f"peak in flight: {report['peak_in_flight']}; audio s per wall s: {report['audio_s_per_wall_s']}; "
              f"server CPU (pid {cpu['pid']}): {cpu['cores']} cores, its children {cpu['children_cores']}"]
    return "\n".join(lines)


def start_local_server(args: argparse.Namespace):
    """A server in a thread of this process, on a free port, once its model is warmed up."""
    from realtime.gateway import GatewayOptions, Limits
    from realtime.server import build_server

    options = GatewayOptions(model=args.model, device=args.device, max_batch=args.max_batch,
                             limits=Limits(max_sessions=max(64, args.sessions, math.ceil(args.rate * 30))))
    server = build_server(options, port=0, log_level="warning")
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started or not server.gateway.readiness()[0]:
        if not thread.is_alive() or server.gateway.state == "failed":
            raise SystemExit(f"the local server did not start: {server.gateway.readiness()[1]}")
        time.sleep(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]
    return server, thread, f"ws://127.0.0.1:{port}/v1/tts/stream"


def token_rate(text: str) -> tuple[float, float]:
    low, _, high = text.partition("-")
    return float(low), float(high or low)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="ws://127.0.0.1:8000/v1/tts/stream")
    parser.add_argument("--serve", action="store_true", help="start a server in this process (ignores --url)")
    parser.add_argument("--model", type=Path, help="with --serve: checkpoint directory (default: the tiny model)")
    parser.add_argument("--device", default="cpu", help="with --serve")
    parser.add_argument("--max-batch", type=int, help="with --serve: engine slots")
    parser.add_argument("--api-key")
    parser.add_argument("--sessions", type=int, default=4)
    parser.add_argument("--processes", type=int, default=1,
                        help="closed loop: client processes the sessions are spread over (one reads ~64 at most)")
    parser.add_argument("--duration", type=float, default=30.0,
                        help="seconds during which new contexts (closed) or requests (open) start")
    parser.add_argument("--drain-s", type=float, default=60.0,
                        help="closed loop: how long after --duration sessions may take to finish their last context "
                             "and close; those still running then are cancelled and reported as stuck")
    parser.add_argument("--token-rate", type=token_rate, default=(20.0, 80.0),
                        help="LLM text rate in tokens/s, a range LOW-HIGH drawn per answer")
    parser.add_argument("--encoding", default="opus", choices=["opus", "pcm_s16le", "mulaw"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--listen", action="store_true",
                        help="closed loop: each session plays its audio (behind a 100 ms buffer) and waits 1-3 s for "
                             "its user before the next context, as a voice chat does (default: the next context at "
                             "once, a stress load)")
    parser.add_argument("--buffering", default="auto", choices=["auto", "none", "sentence"],
                        help="text.buffering of the sessions (none: TTFA from the first token)")
    open_loop_options = parser.add_argument_group("open loop (--mode open)")
    open_loop_options.add_argument("--mode", default="closed", choices=["closed", "open"],
                                   help="closed: --sessions speak one context after another; open: Poisson arrivals")
    open_loop_options.add_argument("--rate", type=float, default=1.0, help="arrivals per second")
    open_loop_options.add_argument("--traffic", default="http", choices=["http", "ws"],
                                   help="http: POST /v1/audio/speech, streamed pcm; ws: a session of one context "
                                        "with LLM-paced text")
    open_loop_options.add_argument("--prompts", type=Path, default=PROMPTS, help="JSONL prompt set, one text a line")
    open_loop_options.add_argument("--voice", help="http: the body's voice (default: the server's)")
    open_loop_options.add_argument("--language", default="English", help="http: the body's language")
    open_loop_options.add_argument("--timeout", type=float, default=120.0, help="seconds before a request gives up")
    open_loop_options.add_argument("--server-pid", type=int,
                                   help="the server process whose CPU to report (default: the one on --url's port)")
    args = parser.parse_args()
    if args.processes < 1 or (args.processes > 1 and (args.mode != "closed" or args.serve)):
        parser.error("--processes: at least 1, and more only for the closed loop against --url")
    if args.mode == "open" and args.traffic == "ws" and args.encoding == "mulaw":
        parser.error("--mode open --traffic ws decodes the audio to find its onset: use opus or pcm_s16le")
    local = None
    if args.serve:
        local = start_local_server(args)
        args.url = local[2]
    server_pid = os.getpid() if args.serve else args.server_pid or listening_pid(urlsplit(args.url).port or 80)
    try:
        report = asyncio.run(bench(args, server_pid) if args.mode == "closed" else open_loop(args, server_pid))
    finally:
        if local is not None:
            local[0].should_exit = True
            local[1].join(timeout=30)
    if args.mode == "open":
        print(table(report), file=sys.stderr)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
