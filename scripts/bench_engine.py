"""GPU benchmark of the batched engine on random real-size weights (EOS held off to fixed lengths).

Parts (all by default): `check` (bf16 agreement with the single-request path), `single` (time to first audio and the
frame step at batch 1), `scaling` (frame-step time by batch size), `offline` (throughput at large batch), `load`
(Poisson arrivals: TTFA percentiles and streams that never underrun in a simulated player). Usage:
    python scripts/bench_engine.py --size 1b7 --parts check,single,scaling,offline,load --rates 10,20,40
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.engine import AudioChunk, Engine, EngineConfig, SynthesisRequest  # noqa: E402
from engine.random_checkpoint import write_random_checkpoint  # noqa: E402
from engine.sampling import SamplingParams  # noqa: E402
from engine.tts import TTSModel, VoiceRequest  # noqa: E402

WORDS = ("the quick brown fox jumps over a lazy dog while music plays softly in the old town hall tonight "
         "and everyone listens to the story about rivers mountains and distant cities").split()
SAMPLE_RATE = 24000
FRAME_S = 0.08


def text_of(seconds: float, rng: random.Random) -> str:
    """About 2.5 words per second of speech."""
    return " ".join(rng.choice(WORDS) for _ in range(max(2, round(2.5 * seconds)))) + "."


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q)) if values else float("nan")


class Bench:
    def __init__(self, tts: TTSModel, args: argparse.Namespace) -> None:
        self.tts, self.args = tts, args
        self.voice = tts.voice(VoiceRequest(speaker="vivian"))
        self._engine: Engine | None = None

    def request(self, frames: int, seed: int, text: str | None = None, greedy: bool = False) -> SynthesisRequest:
        sampling = SamplingParams.from_defaults(self.tts.config.generation, greedy=greedy, seed=seed)
        sampling = SamplingParams(sampling.talker, sampling.code_predictor, sampling.repetition_penalty, seed,
                                  min_new_frames=frames)
        text = text or text_of(frames * FRAME_S, random.Random(seed))
        return SynthesisRequest(text, self.voice, language="english", layout="streaming", sampling=sampling,
                                max_frames=frames)

    def engine(self) -> Engine:
        """One engine for every part, as a server has (graphs captured once, up to --max-batch)."""
        if self._engine is None:
            gpu = self.tts.device.type == "cuda"
            started = time.perf_counter()
            self._engine = Engine(self.tts, EngineConfig(
                max_batch=self.args.max_batch, capacity=self.args.capacity,
                step_mode=self.args.step_mode or ("graphs" if gpu else "padded"),
                attention_backend="triton" if gpu else "sdpa", frame_path=self.args.frame_path or
                ("triton" if gpu else "torch"), max_waiting=100000, first_chunk_frames=1,
                chunk_frames=self.args.chunk_frames, overlap_decoding=self.args.overlap == "on"))
            print(json.dumps({"engine_ready_s": round(time.perf_counter() - started, 1)}), flush=True)
        assert self._engine.idle()
        return self._engine

    def check(self) -> dict:
        """Agreement of the engine's greedy codes (batched, graphed) with the single-request path, in the model's
        dtype and in fp32 (bf16 rounding flips near-ties, and a random model diverges from the first flip on)."""
        out = {str(self.tts.dtype): self._agreement()}
        if self.tts.dtype != torch.float32:
            fp32_args = argparse.Namespace(**{**vars(self.args), "max_batch": 8})
            fp32 = Bench(TTSModel.load(self.tts.model_dir, device=self.tts.device, dtype=torch.float32), fp32_args)
            out["torch.float32"] = fp32._agreement()
            del fp32
        return out

    def _agreement(self) -> dict:
        engine = self.engine()
        requests = [self.request(40, seed, greedy=True) for seed in range(6)]
        codes: dict[int, list] = {}
        original = engine._step

        def recording(batch):
            out = original(batch)
            for slot, frame in zip(batch.slots.tolist(), out.cpu()):
                codes.setdefault(slot, []).append(frame)
            return out

        engine._step = recording
        ids = {engine.submit(r): i for i, r in enumerate(requests)}
        slot_of, audio = {}, {}
        while not engine.idle():
            engine._admit()
            for stream in engine.running.values():
                slot_of[ids[stream.request_id]] = stream.slot
            for event in engine.step():
                if isinstance(event, AudioChunk):
                    audio.setdefault(ids[event.request_id], []).append(event.samples)
        agree = total = 0
        first_difference, audio_difference = [], []
        for i, request in enumerate(requests):
            reference = self.tts.synthesize(request.text, request.voice, language=request.language,
                                            layout=request.layout, sampling=request.sampling,
                                            max_frames=request.max_frames)
            mine = torch.stack(codes[slot_of[i]][: len(reference.codes)])
            same = (mine == reference.codes).all(dim=1)
            agree += int(same.sum())
            total += len(reference.codes)
            first_difference.append(int((~same).nonzero()[0]) if not same.all() else None)
            if same.all():  # the graphed, batched decoder against the offline decode of the same codes
                audio_difference.append(float(np.abs(np.concatenate(audio[i]) - reference.audio).max()))
        return dict(frames_compared=total, frame_agreement=agree / total, first_difference=first_difference,
                    max_audio_difference_where_codes_agree=max(audio_difference, default=None))

    def single(self) -> dict:
        engine = self.engine()
        ttfa, steps = [], []
        for seed in range(self.args.repeats):
            start = time.perf_counter()
            engine.submit(self.request(75, seed))
            first = []

            def seen(events: list) -> None:  # called the moment audio leaves the engine
                if not first and any(isinstance(e, AudioChunk) for e in events):
                    first.append(time.perf_counter() - start)

            while not engine.idle():
                step_start = time.perf_counter()
                seen(engine.step(on_audio=seen))
                steps.append(time.perf_counter() - step_start)
            ttfa.append(first[0])
        return dict(ttfa_ms_p50=percentile(ttfa, 50) * 1e3, ttfa_ms_p95=percentile(ttfa, 95) * 1e3,
                    engine_step_ms_p50=percentile(steps, 50) * 1e3, engine_step_ms_mean=statistics.mean(steps) * 1e3)

    def scaling(self) -> dict:
        """Pure frame step (graph replay + the codes' copy to the host) by batch size, contexts ~100-200."""
        out = {}
        for batch in self.args.batches:
            engine = self.engine()
            for seed in range(batch):
                engine.submit(self.request(400, seed))
            engine._admit()
            for _ in range(100):  # grow the contexts a little
                engine.step()
            streams = list(engine.running.values())
            times = []
            for _ in range(30):
                synchronize()
                start = time.perf_counter()
                engine._step(engine._batch(streams)).cpu()
                times.append(time.perf_counter() - start)
                for s in streams:
                    s.frames += 1
            for s in streams:
                engine.cancel(s.request_id)
            out[batch] = dict(frame_step_ms_p50=percentile(times, 50) * 1e3,
                              x_real_time_per_stream=FRAME_S / percentile(times, 50))
        return out

    def offline(self) -> dict:
        engine = self.engine()
        n = self.args.offline_requests
        for seed in range(n):
            engine.submit(self.request(75, seed))
        synchronize()
        start = time.perf_counter()
        samples = 0
        while not engine.idle():
            samples += sum(len(e.samples) for e in engine.step() if isinstance(e, AudioChunk))
        wall = time.perf_counter() - start
        return dict(requests=n, batch=self.args.max_batch, audio_s=samples / SAMPLE_RATE, wall_s=wall,
                    audio_s_per_wall_s=samples / SAMPLE_RATE / wall)

    def load(self, rate: float) -> dict:
        """Poisson arrivals for `duration` s; lengths 2-12 s (mean ~6 s) from a seeded distribution."""
        rng = random.Random(int(rate * 1000))
        arrivals, t = [], 0.0
        while t < self.args.duration:
            t += rng.expovariate(rate)
            seconds = min(12.0, max(2.0, rng.gauss(6.0, 2.5)))
            arrivals.append((t, round(seconds / FRAME_S)))
        engine = self.engine()
        for seed in range(3):  # warm-up outside the measurement
            engine.submit(self.request(5, seed))
        while not engine.idle():
            engine.step()
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        submitted, pending = {}, list(enumerate(arrivals))
        first, chunks = {}, {}
        samples = 0

        def record(events: list) -> None:  # called the moment events leave the engine
            nonlocal samples
            now = time.perf_counter() - start
            for event in events:
                if isinstance(event, AudioChunk):
                    first.setdefault(event.request_id, now)
                    chunks.setdefault(event.request_id, []).append((now, event.start_sample))
                    samples += len(event.samples)

        while pending or not engine.idle():
            now = time.perf_counter() - start
            while pending and pending[0][1][0] <= now:
                index, (at, frames) = pending.pop(0)
                submitted[engine.submit(self.request(frames, index))] = at
            events = engine.step(on_audio=record)
            record(events)
            now = time.perf_counter() - start
            if engine.idle() and pending:
                time.sleep(max(0.0, min(pending[0][1][0] - now, 0.002)))
        wall = time.perf_counter() - start
        ttfa = [first[i] - submitted[i] for i in submitted]
        # A player starts at the first chunk; a chunk that arrives after its playback time is an underrun.
        smooth = sum(all(arrived <= first[i] + start_sample / SAMPLE_RATE + 1e-9 for arrived, start_sample in
                         chunks[i]) for i in submitted)
        return dict(rate=rate, streams=len(submitted), ttfa_ms_p50=percentile(ttfa, 50) * 1e3,
                    ttfa_ms_p95=percentile(ttfa, 95) * 1e3, ttfa_ms_p99=percentile(ttfa, 99) * 1e3,
                    never_underrun=smooth / len(submitted), audio_s_per_wall_s=samples / SAMPLE_RATE / wall,
                    gpu_peak_gib=torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="1b7", choices=["0b6", "1b7", "tiny"])
    parser.add_argument("--parts", default="check,single,scaling,offline,load")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32, 64, 128])
    parser.add_argument("--offline-requests", type=int, default=256)
    parser.add_argument("--rates", type=lambda s: [float(x) for x in s.split(",")], default=[10.0, 20.0, 40.0])
    parser.add_argument("--duration", type=float, default=30.0)
    parser.add_argument("--max-batch", type=int, default=128)
    parser.add_argument("--capacity", type=int, default=512)
    parser.add_argument("--chunk-frames", type=int, default=4)
    parser.add_argument("--overlap", choices=["on", "off"], default="on",
                        help="decode beside the next frame step (on a GPU)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--frame-path", choices=["torch", "triton"], help="default: triton on a GPU")
    parser.add_argument("--step-mode", choices=["eager", "padded", "graphs"], help="default: graphs on a GPU")
    args = parser.parse_args()
    tmp = tempfile.TemporaryDirectory()
    model_dir = write_random_checkpoint(Path(tmp.name) / "ckpt", args.size, "custom_voice", seed=0)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    bench = Bench(TTSModel.load(model_dir, device=args.device, dtype=dtype), args)
    gpu = torch.cuda.get_device_name() if args.device == "cuda" else None
    result = dict(size=args.size, device=args.device, gpu=gpu, torch=torch.__version__)
    for part in args.parts.split(","):
        started = time.perf_counter()
        result[part] = ([bench.load(rate) for rate in args.rates] if part == "load" else getattr(bench, part)())
        print(json.dumps({part: result[part], "part_s": round(time.perf_counter() - started, 1)}), flush=True)
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
