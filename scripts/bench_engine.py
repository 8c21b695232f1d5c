"""GPU benchmark of the batched engine on random real-size weights (EOS held off to fixed lengths).

Parts (all by default): `check` (bf16 agreement with the single-request path), `single` (time to first audio and the
frame step at batch 1), `first_audio` (where a single request's time to first audio goes, phase by phase, and the
graphed prefill against the eager one), `scaling` (frame-step time by batch size), `offline` (throughput at large
batch), `load` (Poisson arrivals: TTFA percentiles and streams that never underrun in a simulated player),
`streaming` (concurrent sessions whose text arrives like an LLM's, through the real utterance planner and
streaming-text requests), `decoder` (the codec decoder alone: time per graphed call by batch and chunk length,
its arithmetic rate, and its agreement with an fp32 decode on the CPU). Usage:
    python scripts/bench_engine.py --size 1b7 --parts check,single,scaling,offline,load --rates 10,20,40
    python scripts/bench_engine.py --size 1b7 --parts decoder,eager_decoder
    python scripts/bench_engine.py --size 1b7 --parts first_audio --repeats 20
    python scripts/bench_engine.py --size 1b7 --parts admission --burst 64 --repeats 10
    python scripts/bench_engine.py --size 1b7 --parts streaming --sessions 10,40 --token-rates 20-80,5-10
"""
from __future__ import annotations

import argparse
import copy
import json
import random
import statistics
import sys
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.core.codec_decoding import DecoderPool  # noqa: E402
from engine.core.engine import Engine, EngineConfig  # noqa: E402
from engine.core.prefill_graphs import PaddedPrefill  # noqa: E402
from engine.core.simulator import llm_token_times  # noqa: E402
from engine.request import AudioChunk, SynthesisRequest
from engine.sampling import MIN_NEW_FRAMES, SamplingParams  # noqa: E402
from engine.synthetic.checkpoints import write_random_checkpoint  # noqa: E402
from engine.tts import TTSModel, VoiceRequest  # noqa: E402
from realtime.ws.utterances import UtterancePlanner  # noqa: E402

WORDS = ("the quick brown fox jumps over a lazy dog while music plays softly in the old town hall tonight "
         "and everyone listens to the story about rivers mountains and distant cities").split()
SAMPLE_RATE = 24000
FRAME_S = 0.08
DECODER_SHAPES = ((1, 1), (1, 4), (64, 4), (128, 4), (256, 1), (256, 4))  # (batch, frames per call)
EAGER_DECODER_SHAPES = ((1, 3), (1, 100), (1, 250), (8, 3))  # lengths with no graph: a reference's, a final flush's


def text_of(seconds: float, rng: random.Random) -> str:
    """About 2.5 words per second of speech."""
    return " ".join(rng.choice(WORDS) for _ in range(max(2, round(2.5 * seconds)))) + "."


def llm_tokens(seconds: float, rng: random.Random) -> list[str]:
    """An LLM's answer for `seconds` of speech as its tokens: words with their leading space, a comma every few."""
    words = text_of(seconds, rng)[:-1].split()
    tokens = [(" " if i else "") + word + ("," if i % 7 == 6 else "") for i, word in enumerate(words)]
    return tokens[:-1] + [tokens[-1] + "."]


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
                attention_backend="triton" if gpu else None, frame_path=self.args.frame_path or
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
        requests = [self.request(40, seed, greedy=True) for seed in range(6)]
        results = self._codes_and_audio(requests)
        agree = total = 0
        first_difference, audio_difference = [], []
        for request, (codes, audio) in zip(requests, results):
            reference = self.tts.synthesize(request.text, request.voice, language=request.language,
                                            layout=request.layout, sampling=request.sampling,
                                            max_frames=request.max_frames)
            same = (codes[: len(reference.codes)] == reference.codes).all(dim=1)
            agree += int(same.sum())
            total += len(reference.codes)
            first_difference.append(int((~same).nonzero()[0]) if not same.all() else None)
            if same.all():  # the graphed, batched decoder against the offline decode of the same codes
                audio_difference.append(float(np.abs(audio - reference.audio).max()))
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

    def invariance(self) -> dict:
        """PROTOCOL.md's seed guarantee on this device: seeded (sampled) requests run alone, then beside 3 or 15 others
        that joined a few steps earlier (other rows, other graph buckets, other lengths): the share whose codes are
        bit-equal to their run alone, and the largest audio difference. In fp32 a code that differs is a frame-step
        kernel whose reduction depends on the batch, audio that differs with equal codes is the batched decoder; in
        bf16 it shows how often a rounding flip changes a sampled code."""
        probes = [self.request(24, seed) for seed in range(4)]
        alone = [self._codes_and_audio([probe])[0] for probe in probes]
        out = {}
        for companions in (3, 15):
            others = [self.request(16 + 4 * i, 1000 + i) for i in range(companions)]
            batched = self._codes_and_audio(probes, others)
            out[f"codes_bit_equal_beside_{companions}"] = sum(
                torch.equal(a[0], b[0]) for a, b in zip(alone, batched)) / len(probes)
            out[f"audio_bit_equal_beside_{companions}"] = sum(
                np.array_equal(a[1], b[1]) for a, b in zip(alone, batched)) / len(probes)
            out[f"audio_max_abs_diff_beside_{companions}"] = max(
                float(np.abs(a[1] - b[1]).max()) if len(a[1]) == len(b[1]) else float("inf")
                for a, b in zip(alone, batched))
        return out | dict(requests=len(probes), dtype=str(self.tts.dtype))

    def _codes_and_audio(self, requests: list[SynthesisRequest], others: tuple | list = (),
                         head_start: int = 3) -> list[tuple[torch.Tensor, np.ndarray]]:
        """The codes [frames, 16] and whole audio of each of `requests`, submitted `head_start` steps after
        `others`."""
        engine = self.engine()
        original = engine.runner.run
        codes: dict[int, list] = defaultdict(list)  # engine request id -> its frames

        def recording(batch):
            out = original(batch).landed()
            owner = {seq.slot: request_id for request_id, seq in engine.running.items()}
            for slot, frame in zip(batch.slots.tolist(), out.codes):
                codes[owner[slot]].append(frame)
            return out

        engine.runner.run = recording
        try:
            for other in others:
                engine.submit(other)
            for _ in range(head_start if others else 0):
                engine.step()
            ids = {engine.submit(request): index for index, request in enumerate(requests)}
            chunks: dict[int, list] = defaultdict(list)
            while not engine.idle():
                for event in engine.step():
                    if isinstance(event, AudioChunk) and event.request_id in ids:
                        chunks[event.request_id].append(event.samples)
        finally:
            engine.runner.run = original
        return [(torch.stack(codes[request_id]), np.concatenate(chunks[request_id])) for request_id in ids]

    def first_audio(self) -> dict:
        """A single request's first step, phase by phase (planning, prefill, decoder start, frame, decoding), each
        timed with the GPU synchronised at its start and end: the phases sum to a little more than `single`'s
        unsynchronised time to first audio. Then the prefill alone, graphed (as served) and eager, on the same
        prompts, and how far apart their bf16 results are."""
        engine = self.engine()
        phases: dict[str, list[float]] = defaultdict(list)
        recording = [False]

        def timed(name: str, call: Callable) -> Callable:
            def run(*args, **kwargs):
                if not recording[0]:
                    return call(*args, **kwargs)
                synchronize()
                start = time.perf_counter()
                out = call(*args, **kwargs)
                synchronize()
                phases[name].append(time.perf_counter() - start)
                return out
            return run

        runner, decoding = engine.runner, engine.decoding
        original_run = runner.run
        runner.prefill, decoding.start = timed("prefill", runner.prefill), timed("decoder_start", decoding.start)
        runner.run, decoding.queue = timed("frame", original_run), timed("decode_queue", decoding.queue)
        decoding.collect = timed("decode_collect", decoding.collect)
        plan = timed("plan", engine.submit)
        try:
            for seed in range(self.args.repeats):
                recording[0] = True
                plan(self.request(8, seed))
                while recording[0]:
                    recording[0] = not any(isinstance(e, AudioChunk) for e in engine.step())
                while not engine.idle():
                    engine.step()
        finally:
            runner.run = original_run
            del runner.prefill, decoding.start, decoding.queue, decoding.collect
        out = {f"{name}_ms_p50": percentile(times, 50) * 1e3 for name, times in phases.items()}
        return out | self._prefill_timing(engine)

    def admission(self) -> dict:
        """A burst's admission, as a busy server's engine pays it: `--burst` streaming-text requests with their first
        words in, admitted by one call, timed on the host without a synchronisation (the GPU work is queued, not
        waited for); ms per request, the first burst (nothing kept from earlier prompts) and the p50 of the rest."""
        engine = self.engine()
        bursts = []
        for seed in range(self.args.repeats):
            texts = [text_of(2.0, random.Random(1000 * seed + i)) for i in range(self.args.burst)]
            ids = [engine.submit(replace(self.request(8, 1000 * seed + i, text), text_complete=False, max_frames=None))
                   for i, text in enumerate(texts)]
            synchronize()
            start = time.perf_counter()
            engine._admit()
            bursts.append((time.perf_counter() - start) / len(ids))
            assert all(engine.scheduler.find(i) in engine.scheduler.running.values() for i in ids)
            for request_id in ids:
                engine.cancel(request_id)
            while not engine.idle():
                engine.step()
        return dict(burst=self.args.burst, first_ms_per_request=round(bursts[0] * 1e3, 3),
                    ms_per_request_p50=round(percentile(bursts[1:] or bursts, 50) * 1e3, 3))

    def _prefill_timing(self, engine: Engine) -> dict:
        """The served prefill (padded, graphed) against the eager varlen pass, on the same prompts in free slots."""
        frame = engine.runner.frame
        served = frame.prefill
        if not isinstance(served, PaddedPrefill):
            return {}
        eager = PaddedPrefill(served.tokens, engine.runner.last_hidden.shape[1], engine.tts.dtype,
                              engine.tts.device, served.scratch_slot, engine.runner.capacity, buckets=(), capture=False)
        out = {}
        for count in (n for n in (1, 4, 16, 64) if n <= engine.slots):
            prompts = [self.tts.plan(self.request(8, seed).text, self.voice, language="english",
                                     layout="streaming").prompt.prefill for seed in range(count)]
            slots = list(range(count))
            results = {}
            for name, prefill in (("graphed", served), ("eager", eager)):
                times = []
                for _ in range(self.args.repeats):
                    synchronize()
                    start = time.perf_counter()
                    results[name] = prefill([p.clone() for p in prompts], slots)
                    synchronize()
                    times.append(time.perf_counter() - start)
                out[f"prefill_{name}_ms_p50_{count}_prompts"] = percentile(times, 50) * 1e3
            graphed, eager_hidden = results["graphed"].float(), results["eager"].float()
            out[f"prefill_{count}_prompts_tokens"] = sum(p.shape[0] for p in prompts)
            out[f"prefill_{count}_prompts_bit_equal"] = (graphed == eager_hidden).float().mean().item()
            out[f"prefill_{count}_prompts_max_abs_diff"] = (graphed - eager_hidden).abs().max().item()
        return out

    def scaling(self) -> dict:
        """Pure frame step (both graph replays, the codes' copy to the host) by batch size, contexts ~100-200."""
        out = {}
        for batch in self.args.batches:
            engine = self.engine()
            for seed in range(batch):
                engine.submit(self.request(400, seed))
            engine._admit()
            for _ in range(100):  # grow the contexts a little
                engine.step()
            seqs = list(engine.running.values())
            times = []
            for _ in range(30):
                synchronize()
                start = time.perf_counter()
                engine.runner.run(engine.runner.batch(seqs)).host()
                synchronize()  # the step's second half (the advance) too
                times.append(time.perf_counter() - start)
                for s in seqs:
                    s.frames += 1
            for s in seqs:
                engine.cancel(s.request_id)
            while not engine.idle():  # decodes queued before the cancels land
                engine.step()
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

    def decoder(self) -> dict:
        """The codec decoder alone, as the engine runs it (a `DecoderPool` of 256 slots, graphed on a GPU): the time
        of one call by (batch, frames), with the codes' upload; audio seconds per wall second; TFLOP/s from the
        FLOPs PyTorch counts for one frame. Then how far its audio is from an fp32 decode on the CPU."""
        tts = self.tts
        pool = self._decoder_pool(capture=self.tts.device.type == "cuda")
        flops = decoder_flops_per_frame(tts)
        out: dict = dict(gflop_per_frame=flops / 1e9)
        generator = torch.Generator().manual_seed(0)
        for (batch, frames), times in self._time_decodes(pool, DECODER_SHAPES, generator).items():
            seconds = percentile(times[3:], 50)  # the first calls warm up
            out[f"{batch}x{frames}"] = dict(ms_per_call=seconds * 1e3,
                                            audio_s_per_wall_s=batch * frames * FRAME_S / seconds,
                                            tflop_s=flops * batch * frames / seconds / 1e12)
        out["agreement"] = decoder_agreement(tts, generator)
        return out

    def eager_decoder(self) -> dict:
        """Decodes of lengths that have no graph, as a voice-clone reference's decode runs (once per request, in
        the step loop, one request a call): the first call's time (cuDNN's heuristics, no timing) and the median of
        the later ones. A slow one here stalls every stream of the engine."""
        pool = self._decoder_pool(capture=False)  # a captured pool's eager calls run the same path
        generator = torch.Generator().manual_seed(0)
        return {f"{batch}x{frames}": dict(first_ms=times[0] * 1e3, later_ms=percentile(times[1:], 50) * 1e3)
                for (batch, frames), times in self._time_decodes(pool, EAGER_DECODER_SHAPES, generator).items()}

    def _decoder_pool(self, capture: bool) -> DecoderPool:
        tts = self.tts
        return DecoderPool(tts.decoder, 256, tts.device, tts.dtype, capture=capture, chunk_lengths=(1, 4))

    def _time_decodes(self, pool: DecoderPool, shapes: tuple[tuple[int, int], ...], generator: torch.Generator
                      ) -> dict[tuple[int, int], list[float]]:
        """Seconds of each of `repeats + 3` calls per (batch, frames), codes upload included, on fresh states."""
        quantizers, codebook = self.tts.decoder.cfg.num_quantizers, self.tts.decoder.cfg.codebook_size
        out = {}
        for batch, frames in shapes:
            codes = torch.randint(0, codebook, (batch, frames, quantizers), generator=generator)
            slots = list(range(batch))
            times = []
            for _ in range(self.args.repeats + 3):
                pool.reset(slots)
                synchronize()
                start = time.perf_counter()
                pool.decode(slots, codes)
                synchronize()
                times.append(time.perf_counter() - start)
            out[(batch, frames)] = times
        return out

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

    def streaming(self) -> list[dict]:
        self.engine()
        for _ in range(self.args.busy_threads):  # from here on: the engine is built
            threading.Thread(target=_spin, daemon=True).start()
        return [self.streaming_sessions(sessions, rate, buffering) for rate in self.args.token_rates
                for sessions in self.args.sessions for buffering in self.args.buffering]

    def streaming_sessions(self, sessions: int, token_rate: tuple[float, float], buffering: str) -> dict:
        """`sessions` clients, each asking for one answer after another (a pause of 0.2-1 s between), whose text
        arrives like an LLM's (first token after 100-300 ms, then `token_rate` tokens/s in pieces of 1-4) for
        `duration` s. Latency runs from the first text token to the first audio out of the engine; a stream
        underruns when a chunk leaves after its playback time (playback from its first audio); a hold lasts from
        the first step that skips a stream for lack of text to the next step that runs it."""
        engine = self.engine()
        clients = [StreamingSession(self, random.Random(1000 * sessions + i), token_rate, buffering)
                   for i in range(sessions)]
        contexts: list[dict] = []
        by_request: dict[int, tuple[StreamingSession, dict]] = {}
        running: list[int] = []
        step_seconds: list[float] = []
        start = time.perf_counter()

        def record(events: list) -> None:
            now = time.perf_counter() - start
            for event in events:
                client, context = by_request[event.request_id]
                if isinstance(event, AudioChunk):
                    context["chunks"].append((now, event.start_sample))
                elif client.context is context:
                    client.finished(now)

        while True:
            now = time.perf_counter() - start
            if now >= self.args.duration and engine.idle():
                break
            for client in clients:
                if client.context is not None or now < self.args.duration:
                    client.tick(engine, now, contexts, seed=len(contexts))
                    if client.context is not None and client.context["request_id"] is not None:
                        by_request[client.context["request_id"]] = (client, client.context)
            self._note_holds(engine, by_request, now)
            if engine.has_work():
                running.append(len(engine.running))  # what the gateway's voxgate_engine_step_batch counts
                step_started = time.perf_counter()
                record(engine.step(on_audio=record))
                step_seconds.append(time.perf_counter() - step_started)
            else:
                wake = min([c.next_event() for c in clients] + [self.args.duration])
                time.sleep(max(0.0, min(wake - now, 0.002)))
        done = [c for c in contexts if c["chunks"]]
        latency = [c["chunks"][0][0] - c["times"][0] for c in done]
        ttfa = [c["chunks"][0][0] - c["started_at"] for c in done]
        # per stream: (how late its latest chunk was in ms, at which frame of how many)
        worst = [max((arrived - c["chunks"][0][0] - sample / SAMPLE_RATE, round(sample / SAMPLE_RATE / FRAME_S), c["frames"])
                     for arrived, sample in c["chunks"]) for c in done]
        late = [(round(seconds * 1e3, 1), frame, frames) for seconds, frame, frames in worst if seconds > 1e-9]
        holds = [h for c in done for h in c["holds"]]
        return dict(sessions=sessions, tokens_per_s=list(token_rate), buffering=buffering, streams=len(done),
                    first_token_to_audio_ms_p50=percentile(latency, 50) * 1e3,
                    first_token_to_audio_ms_p95=percentile(latency, 95) * 1e3,
                    ttfa_from_start_ms_p50=percentile(ttfa, 50) * 1e3, ttfa_from_start_ms_p95=percentile(ttfa, 95) * 1e3,
                    never_underrun=1 - len(late) / max(1, len(done)), underruns_late_ms_at_frame_of=late[:20],
                    holds_per_stream=len(holds) / max(1, len(done)),
                    hold_ms_p50=percentile(holds, 50) * 1e3, hold_ms_p95=percentile(holds, 95) * 1e3,
                    hold_ms_max=max(holds, default=0.0) * 1e3, streaming_lengths=self.args.streaming_lengths,
                    step_ms_mean=1e3 * sum(step_seconds) / max(1, len(step_seconds)),
                    running_mean=sum(running) / max(1, len(running)))

    @staticmethod
    def _note_holds(engine: Engine, by_request: dict, now: float) -> None:
        for seq in engine.running.values():
            context = by_request[seq.request_id][1]
            if seq.text_id() is None and seq.frames < seq.max_frames:
                context["held_since"] = context["held_since"] if context["held_since"] is not None else now
            elif context["held_since"] is not None:
                context["holds"].append(now - context["held_since"])
                context["held_since"] = None


class StreamingSession:
    """One client session: contexts one after another, each an LLM answer streamed token by token into the utterance
    planner (buffering `auto` or `none`), its started text forwarded to one streaming-text request."""

    def __init__(self, bench: Bench, rng: random.Random, token_rate: tuple[float, float], buffering: str) -> None:
        self.bench, self.rng, self.token_rate, self.buffering = bench, rng, token_rate, buffering
        self.next_start = rng.uniform(0.0, 1.0)
        self.context: dict | None = None

    def tick(self, engine: Engine, now: float, contexts: list[dict], seed: int) -> None:
        """Start a context when due, and hand the text that has arrived to the planner and the engine."""
        if self.context is None and now >= self.next_start:
            frames = round(min(12.0, max(2.0, self.rng.gauss(6.0, 2.5))) / FRAME_S)
            tokens = llm_tokens(frames * FRAME_S, self.rng)
            times = llm_token_times(self.rng, now, len(tokens), self.rng.uniform(*self.token_rate))
            self.context = dict(frames=frames, seed=seed, tokens=tokens, times=times, given=0, request_id=None,
                                planner=UtterancePlanner(self.buffering), chunks=[], holds=[], held_since=None)
            contexts.append(self.context)
        context = self.context
        if context is None:
            return
        planner: UtterancePlanner = context["planner"]
        while context["given"] < len(context["tokens"]) and context["times"][context["given"]] <= now:
            planner.append(context["tokens"][context["given"]], now)
            context["given"] += 1
        if context["given"] == len(context["tokens"]):
            planner.close()
        utterance = planner.utterances[0] if planner.utterances else None
        if context["request_id"] is None and utterance is not None and (planner.start_due(now) or utterance.started):
            request = replace(self.bench.request(context["frames"], context["seed"], utterance.text),
                              text_complete=False)
            if self.bench.args.streaming_lengths == "guard":  # as the gateway: the runaway guard ends it
                request = replace(request, max_frames=None,
                                  sampling=replace(request.sampling, min_new_frames=MIN_NEW_FRAMES))
            context["request_id"] = engine.submit(request)
            context["started_at"], context["sent"] = now, len(utterance.text)
        elif context["request_id"] is not None and len(utterance.text) > context["sent"]:
            engine.append_text(context["request_id"], utterance.text[context["sent"]:])
            context["sent"] = len(utterance.text)
        if context["request_id"] is not None and utterance.closed and not context.get("ended"):
            engine.end_text(context["request_id"])
            context["ended"] = True

    def finished(self, now: float) -> None:
        self.context["finished_at"] = now
        self.context = None
        self.next_start = now + self.rng.uniform(0.2, 1.0)  # the user listens, then asks again

    def next_event(self) -> float:
        if self.context is None:
            return self.next_start
        given = self.context["given"]
        return self.context["times"][given] if given < len(self.context["times"]) else float("inf")


def decoder_flops_per_frame(tts: TTSModel) -> float:
    """FLOPs of one frame of the codec decoder (convolutions and matrix products, as PyTorch counts them)."""
    from torch.utils.flop_counter import FlopCounterMode
    decoder, frames = tts.decoder, 4
    codes = torch.zeros(1, frames, decoder.cfg.num_quantizers, dtype=torch.long, device=tts.device)
    counter = FlopCounterMode(display=False)
    with torch.inference_mode(), counter:
        decoder.decode_step(codes, decoder.new_state(1, tts.device, tts.dtype))
    return counter.get_total_flops() / frames


def decoder_agreement(tts: TTSModel, generator: torch.Generator) -> dict:
    """The decoder's audio for 12 random frames on the device (its fast path on a GPU: fused SnakeBeta, channels-minor
    convolutions, the transformer's kernels), in the model dtype and in fp32, and 100 frames streamed in fp32 in
    4-frame chunks, against the fp32 decode on the CPU by the plain path (the reference arithmetic)."""
    cfg = tts.decoder.cfg
    codes = torch.randint(0, cfg.codebook_size, (2, 12, cfg.num_quantizers), generator=generator)
    reference = copy.deepcopy(tts.decoder).float().cpu()
    fast = copy.deepcopy(tts.decoder)
    fast.use_fast_path(tts.device.type == "cuda")
    long_codes = torch.randint(0, cfg.codebook_size, (2, 100, cfg.num_quantizers), generator=generator)
    with torch.inference_mode():
        exact = reference.decode(codes)
        model_dtype = fast.decode(codes.to(tts.device)).float().cpu()
        fp32 = fast.float().decode(codes.to(tts.device)).cpu()
        # streamed in the engine's 4-frame chunks past the transformer's 72-frame window (its kernel's shifts)
        state = fast.new_state(2, tts.device, torch.float32)
        streamed = torch.cat([fast.decode_step(long_codes[:, at:at + 4].to(tts.device), state).cpu()
                              for at in range(0, 100, 4)], dim=1)
        long_exact = reference.decode(long_codes)
    scale = exact.abs().max().item()
    kernel = (conv_kernel_agreement(tts.device) | codebook_agreement(tts, generator)) if tts.device.type == "cuda" \
        else {}
    return kernel | dict(fp32_max_abs_error=(fp32 - exact).abs().max().item(),
                         fp32_streamed_100_frames_max_abs_error=(streamed - long_exact).abs().max().item(),
                model_dtype_max_abs_error=(model_dtype - exact).abs().max().item(), audio_peak=scale,
                model_dtype_snr_db=10 * np.log10((exact ** 2).mean().item() /
                                                 max(((model_dtype - exact) ** 2).mean().item(), 1e-30)))


def conv_kernel_agreement(device: torch.device) -> dict:
    """The decoder's elementwise kernels against PyTorch on the GPU, on random activations of the decoder's scale:
    SnakeBeta + padding (the share of bit-equal values in bf16, the largest difference in fp32), and the bias +
    residual add (the share of bit-equal values, expected 1 in both dtypes)."""
    from engine.kernels.conv_elementwise import add_bias_residual, snake_padded
    from engine.model.codec_decoder import SnakeBeta
    generator = torch.Generator().manual_seed(1)
    snake = SnakeBeta(96)
    snake.alpha.data, snake.beta.data = torch.randn(2, 96, generator=generator) * 0.5
    x = torch.randn(8, 96, 1920, generator=generator) * 3
    past = torch.randn(8, 96, 6, generator=generator)
    residual, bias = torch.randn(8, 96, 1920, generator=generator), torch.randn(96, generator=generator)
    out = {}
    for dtype in (torch.bfloat16, torch.float32):
        module, xd, pd = snake.to(device, dtype), x.to(device, dtype), past.to(device, dtype)
        rd, bd = residual.to(device, dtype), bias.to(device, dtype)
        with torch.inference_mode():
            fused, expected = snake_padded(xd, module.alpha, module.beta, pd, 6), torch.cat((pd, module(xd)), -1)
            added = add_bias_residual(rd, xd, bd) == rd + (xd + bd[:, None])
        key = str(dtype).removeprefix("torch.")
        out[f"snake_kernel_{key}_bit_equal"] = (fused == expected).float().mean().item()
        out[f"snake_kernel_{key}_max_abs_diff"] = (fused.float() - expected.float()).abs().max().item()
        out[f"bias_residual_kernel_{key}_bit_equal"] = added.float().mean().item()
        out |= {f"pointwise_residual_kernel_{key}_{name}": value
                for name, value in pointwise_residual_agreement(device, dtype, generator).items()}
    return out


def codebook_agreement(tts: TTSModel, generator: torch.Generator) -> dict:
    """A frame's codebook lookups and sums as one kernel (`SplitQuantizer.fused_decode`) against the plain quantizer,
    in bf16 and fp32, 256 rows x 4 frames with some codes negative (read as 0): the share of bit-equal values (the
    kernel rounds each partial sum as the plain path does: expected 1)."""
    cfg = tts.decoder.cfg
    codes = torch.randint(-1, cfg.codebook_size, (256, 4, cfg.num_quantizers), generator=generator).to(tts.device)
    out = {}
    for dtype in (torch.bfloat16, torch.float32):
        quantizer = copy.deepcopy(tts.decoder.quantizer).to(dtype)
        with torch.inference_mode():
            equal = quantizer.fused_decode(codes) == quantizer.decode(codes)
        out[f"codebook_kernel_{str(dtype).removeprefix('torch.')}_bit_equal"] = equal.float().mean().item()
    return out


def pointwise_residual_agreement(device: torch.device, dtype: torch.dtype, generator: torch.Generator) -> dict:
    """A residual unit's second half as one kernel (`ResidualUnit.fused_tail`) against the kernels it replaced (the
    padding kernel's bias + SnakeBeta, cuDNN's 1x1 convolution, `add_bias_residual`), on the last block's shape: the
    share of bit-equal values and the largest difference against the output's scale (the sums' order differs)."""
    from engine.kernels.conv_elementwise import add_bias_residual, snake_padded
    from engine.model.codec_decoder import ResidualUnit
    unit = ResidualUnit("unit", 96, 1)
    for parameter in unit.parameters():
        parameter.data = torch.randn(parameter.shape, generator=generator) * 0.3
    unit = unit.to(device, dtype)
    hidden = torch.randn(8, 1920, 96, generator=generator).to(device, dtype).transpose(1, 2)
    residual = torch.randn(8, 1920, 96, generator=generator).to(device, dtype).transpose(1, 2)
    with torch.inference_mode():
        fused = unit.fused_tail(residual, hidden)
        activated = snake_padded(hidden, unit.act2.alpha, unit.act2.beta, None, 0, True, unit.conv1.conv.bias)
        conv = F.conv1d(activated, unit.conv2.conv.weight)
        separate = add_bias_residual(residual, conv, unit.conv2.conv.bias)
    return dict(bit_equal=(fused == separate).float().mean().item(),
                max_abs_diff=(fused.float() - separate.float()).abs().max().item(),
                scale=separate.float().abs().max().item())


def _spin() -> None:
    """Pure Python work that holds the GIL, as a server's event loop and encoder threads do beside the engine."""
    while True:
        sum(range(1000))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="1b7", choices=["0b6", "1b7", "tiny"])
    parser.add_argument("--parts", default="check,single,scaling,offline,load")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32, 64, 128])
    parser.add_argument("--offline-requests", type=int, default=256)
    parser.add_argument("--rates", type=lambda s: [float(x) for x in s.split(",")], default=[10.0, 20.0, 40.0])
    parser.add_argument("--duration", type=float, default=30.0)
    parser.add_argument("--sessions", type=lambda s: [int(x) for x in s.split(",")], default=[10, 40])
    parser.add_argument("--token-rates", default=[(20.0, 80.0), (5.0, 10.0)],
                        type=lambda s: [tuple(float(x) for x in r.split("-")) for r in s.split(",")],
                        help="LLM text rates in tokens/s, each a range LOW-HIGH drawn per answer")
    parser.add_argument("--buffering", type=lambda s: s.split(","), default=["auto"])
    parser.add_argument("--busy-threads", type=int, default=0,
                        help="Python threads spinning beside the engine (its sensitivity to the GIL)")
    parser.add_argument("--streaming-lengths", choices=["fixed", "guard"], default="fixed",
                        help="streaming: 2-12 s per context, or until the runaway guard (random weights: as served)")
    parser.add_argument("--burst", type=int, default=64, help="requests admitted at once (`admission`)")
    parser.add_argument("--max-batch", type=int, default=128)
    parser.add_argument("--capacity", type=int, default=512)
    parser.add_argument("--chunk-frames", type=int, default=4)
    parser.add_argument("--overlap", choices=["on", "off"], default="on",
                        help="decode beside the next frame step (on a GPU)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", choices=["bf16", "fp32"], help="default: bf16 on a GPU, fp32 on the CPU")
    parser.add_argument("--frame-path", choices=["torch", "triton"], help="default: triton on a GPU")
    parser.add_argument("--step-mode", choices=["eager", "padded", "graphs"], help="default: graphs on a GPU")
    args = parser.parse_args()
    tmp = tempfile.TemporaryDirectory()
    model_dir = write_random_checkpoint(Path(tmp.name) / "ckpt", args.size, "custom_voice", seed=0)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype or ("bf16" if args.device == "cuda" else "fp32")]
    bench = Bench(TTSModel.load(model_dir, device=args.device, dtype=dtype), args)
    gpu = torch.cuda.get_device_name() if args.device == "cuda" else None
    result = dict(size=args.size, device=args.device, gpu=gpu, torch=torch.__version__)
    for part in args.parts.split(","):
        started = time.perf_counter()
        result[part] = [bench.load(rate) for rate in args.rates] if part == "load" else getattr(bench, part)()
        print(json.dumps({part: result[part], "part_s": round(time.perf_counter() - started, 1)}), flush=True)
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
