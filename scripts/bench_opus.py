"""The CPU cost of the gateway's Opus encoding, per stream: `realtime.audio.encoders.StreamEncoder` (soxr resampling
where the rate is not the model's, framing, libopus) on speech-like audio, for each Opus mode (`OPUS_MODES`: CELT
alone, or libopus's speech modes) and complexity at 24 and 48 kHz.

Cost is CPU microseconds per second of audio (the thread's CPU time): 10,000 us/s is 1% of a core per real-time
stream, and 1e6 / cost the streams one core keeps up with. Threads: the same work on N threads at once, each its own
streams, as the gateway's encoder threads run; if the ctypes calls into libopus release the GIL (they should) the
throughput grows with the free cores, and a probe thread keeps running beside an encoding one (`gil_probe`). Quality per complexity: the stream decoded by libopus, aligned by the encoder's
lookahead, against the input: SNR (of the waveform, which Opus's speech modes need not keep) and the log-spectral
distance (dB, speech frames only; nearer what a listener hears). No audio files here: the input is synthetic
speech (`speech_like`), deterministic. Prints one JSON object (docs/benchmarks.md, "Opus encoder cost per stream").
    python scripts/bench_opus.py
    python scripts/bench_opus.py --seconds 1 --complexities 0,10 --threads 1,2
"""
from __future__ import annotations

import argparse
import ctypes
import itertools
import json
import os
import platform
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np
import opuslib_next as opuslib
import soxr

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from realtime.audio.encoders import OPUS_COMPLEXITY, OPUS_MODES, StreamEncoder, opus_mode  # noqa: E402
from realtime.audio.formats import MODEL_SAMPLE_RATE, AudioFormat, EncodedFrame, to_int16  # noqa: E402

CHUNK_SAMPLES = 2 * 1920  # the engine hands audio over in chunks of 80 ms frames: two of them
# vowel formants (Hz) of an adult voice, from Peterson & Barney's averages; F4 fixed
VOWELS = ((730, 1090, 2440), (270, 2290, 3010), (300, 870, 2240), (530, 1840, 2480), (570, 840, 2410),
          (660, 1720, 2410), (490, 1350, 1690))
BANDWIDTHS = (80.0, 100.0, 150.0, 250.0)
F4 = 3500.0
NOISE_DBFS = -60.0  # the room behind the voice


def speech_like(seconds: float, rate: int = MODEL_SAMPLE_RATE, seed: int = 0) -> np.ndarray:
    """Deterministic speech-like float32 audio: phrases of syllables (a fricative onset half the time, then a vowel
    whose formants glide to the next) with pauses between phrases; voiced sound is a glottal source (harmonics of a
    wandering, declining pitch with the source's -12 dB/octave and the lips' +6) shaped by four formant resonances,
    plus breath; fricatives are band-passed noise; under it all, faint noise. About -20 dBFS RMS while speaking."""
    rng = np.random.default_rng(seed)
    n = int(seconds * rate)
    voiced, unvoiced = np.zeros(n), np.zeros(n)
    fricative_band = np.zeros(n)  # 0: "sh" (2-5 kHz), 1: "s" (4-10 kHz)
    formants = np.zeros((3, n))
    f0 = np.zeros(n)
    at, vowel = 0, rng.integers(len(VOWELS))
    while at < n:
        phrase_end = min(n, at + int(rng.uniform(0.8, 2.5) * rate))
        base = rng.uniform(110, 170)
        phrase_start = at
        while at < phrase_end:
            if rng.random() < 0.5:  # a fricative onset
                length = int(rng.uniform(0.04, 0.1) * rate)
                end = min(phrase_end, at + length)
                unvoiced[at:end] = np.hanning(2 * (end - at) + 2)[1:end - at + 1] ** 0.5 * rng.uniform(0.3, 0.6)
                fricative_band[at:end] = rng.integers(2)
                at = end
            length = int(rng.uniform(0.1, 0.28) * rate)
            end = min(phrase_end, at + length)
            if end <= at:
                break
            following = rng.integers(len(VOWELS))
            glide = np.linspace(0, 1, end - at)[None, :]
            formants[:, at:end] = (np.array(VOWELS[vowel])[:, None] * (1 - glide ** 2)
                                   + np.array(VOWELS[following])[:, None] * glide ** 2)
            envelope = np.sin(np.linspace(0, np.pi, end - at)) ** 0.6
            voiced[at:end] = envelope * rng.uniform(0.6, 1.0)
            progress = (np.arange(at, end) - phrase_start) / max(1, phrase_end - phrase_start)
            f0[at:end] = base * (1.15 - 0.3 * progress) * (1 + 0.08 * np.sin(np.linspace(0, np.pi, end - at)))
            vowel, at = following, end
        at = phrase_end + int(rng.uniform(0.15, 0.6) * rate)  # the pause
    knots = np.arange(0, n + rate // 20, rate // 20)
    wander = np.interp(np.arange(n), knots, rng.normal(0, 0.02, len(knots)))  # slow jitter, every 50 ms, smoothed
    f0 = np.where(f0 > 0, f0 * (1 + wander), 120.0)
    audio = _glottal_voice(f0, formants, rate) * voiced
    audio += _band_noise(rng, n, rate, 200, 6000) * voiced * 0.03  # breath in the voice
    audio += (_band_noise(rng, n, rate, 2000, 5000) * (fricative_band == 0)
              + _band_noise(rng, n, rate, 4000, 10000) * (fricative_band == 1)) * unvoiced * 0.25
    speaking = (voiced + unvoiced) > 0.05
    audio *= 0.1 / np.sqrt(np.mean(audio[speaking] ** 2))  # -20 dBFS while speaking
    audio += rng.normal(0, 10 ** (NOISE_DBFS / 20), n)
    return np.clip(audio, -0.99, 0.99).astype(np.float32)


def _glottal_voice(f0: np.ndarray, formants: np.ndarray, rate: int, block: int = 4800) -> np.ndarray:
    """Harmonics of `f0`, each at the glottal source's and the formant resonances' gain at its frequency: the
    spectrum of a pulse train through the vocal tract's filters, synthesized directly (no per-sample recursion)."""
    phase = 2 * np.pi * np.cumsum(f0) / rate
    out = np.zeros(len(f0))
    top = 0.45 * rate
    for start in range(0, len(f0), block):
        pitch, tract = f0[start:start + block], formants[:, start:start + block]
        harmonics = np.arange(1, int(top / pitch.min()) + 1)[:, None]
        freq = harmonics * pitch[None, :]
        gain = 1.0 / harmonics  # source -12 dB/octave, lips +6
        for centre, bandwidth in zip((*tract, np.full(len(pitch), F4)), BANDWIDTHS):
            gain = gain * centre ** 2 / np.sqrt((centre ** 2 - freq ** 2) ** 2 + (bandwidth * freq) ** 2)
        gain = np.where(freq < top, gain, 0.0)
        out[start:start + block] = np.sum(gain * np.sin(harmonics * phase[None, start:start + block]), axis=0)
    return out


def _band_noise(rng: np.random.Generator, n: int, rate: int, low: float, high: float) -> np.ndarray:
    """White noise kept between `low` and `high` Hz, unit RMS."""
    spectrum = np.fft.rfft(rng.normal(0, 1, n))
    freqs = np.fft.rfftfreq(n, 1 / rate)
    noise = np.fft.irfft(spectrum * ((freqs >= low) & (freqs <= high)), n)
    return noise / np.sqrt(np.mean(noise ** 2))


def encode_stream(samples: np.ndarray, fmt: AudioFormat, complexity: int,
                  mode: str | None = None) -> tuple[list[EncodedFrame], float, int]:
    """The samples through one StreamEncoder in the engine's chunks: its frames, the thread's CPU seconds, and the
    encoder's lookahead at the output rate."""
    started = time.thread_time()
    encoder = StreamEncoder(fmt, complexity=complexity, mode=mode)
    frames = [frame for at in range(0, len(samples), CHUNK_SAMPLES)
              for frame in encoder.encode(samples[at:at + CHUNK_SAMPLES])]
    frames += encoder.finish()
    return frames, time.thread_time() - started, encoder.pre_skip


def decode(frames: list[EncodedFrame], rate: int) -> np.ndarray:
    decoder = opuslib.Decoder(rate, 1)
    pcm = b"".join(decoder.decode(frame.payload, rate * 120 // 1000) for frame in frames)
    return np.frombuffer(pcm, "<i2").astype(np.float32) / 32768


def quality(samples: np.ndarray, decoded: np.ndarray, rate: int, pre_skip: int) -> dict[str, float]:
    """SNR and log-spectral distance of the decoded stream against the input at the output rate, aligned by the
    lookahead (fine-tuned by cross-correlation within 2 ms, for the resampler's rounding)."""
    reference = samples if rate == MODEL_SAMPLE_RATE else soxr.resample(samples, MODEL_SAMPLE_RATE, rate, "HQ")
    reach = rate // 500
    head = reference[: min(len(reference), rate * 2) - reach]
    scores = [float(np.dot(head, decoded[pre_skip + lag: pre_skip + lag + len(head)])) for lag in range(-reach, reach)]
    lag = int(np.argmax(scores)) - reach
    aligned = decoded[pre_skip + lag: pre_skip + lag + len(reference)]
    error = reference[: len(aligned)] - aligned
    snr = 10 * np.log10(np.sum(reference[: len(aligned)] ** 2) / max(np.sum(error ** 2), 1e-20))
    return {"snr_db": round(float(snr), 2), "lsd_db": round(log_spectral_distance(reference[: len(aligned)],
                                                                                  aligned, rate), 2), "lag": lag}


def log_spectral_distance(reference: np.ndarray, decoded: np.ndarray, rate: int) -> float:
    """Mean over the reference's speech frames (20 ms, within 40 dB of its loudest) of the RMS difference in dB of
    the two power spectra up to 12 kHz (where the model's 24 kHz audio ends), each floored 80 dB below the
    reference's peak."""
    size = rate // 50
    window = np.hanning(size)
    frames = len(reference) // (size // 2) - 1
    index = np.arange(size)[None, :] + (size // 2) * np.arange(frames)[:, None]
    power = [np.abs(np.fft.rfft(signal[index] * window, axis=1)) ** 2 for signal in (reference, decoded)]
    band = np.fft.rfftfreq(size, 1 / rate) <= MODEL_SAMPLE_RATE / 2
    floor = power[0].max() * 1e-8
    ref_db, dec_db = (10 * np.log10(np.maximum(p[:, band], floor)) for p in power)
    energy = 10 * np.log10(power[0].sum(axis=1) + 1e-30)
    speech = energy > energy.max() - 40
    return float(np.mean(np.sqrt(np.mean((ref_db[speech] - dec_db[speech]) ** 2, axis=1))))


def cost_rows(samples: np.ndarray, rates: list[int], complexities: list[int], repeats: int, bitrate: int,
              modes: list[str]) -> list[dict]:
    seconds = len(samples) / MODEL_SAMPLE_RATE
    rows = []
    for rate in rates:
        fmt = AudioFormat("opus", rate, 20, bitrate)
        _, pcm_cpu, _ = encode_stream(samples, AudioFormat("pcm_s16le", rate, 20), 0)  # resampling + framing alone
        for mode, complexity in itertools.product(modes, complexities):
            runs = [encode_stream(samples, fmt, complexity, mode) for _ in range(repeats)]
            frames, _, pre_skip = runs[0]
            cost = statistics.median(cpu for _, cpu, _ in runs) / seconds * 1e6
            rows.append({"rate": rate, "mode": mode, "gateways_mode": mode == opus_mode(fmt),
                         "complexity": complexity, "cpu_us_per_audio_s": round(cost),
                         "core_share_per_stream": round(cost / 1e6, 5), "streams_per_core": round(1e6 / cost),
                         "kbit_s": round(sum(len(f.payload) for f in frames) * 8 / seconds / 1000, 2),
                         **quality(samples, decode(frames, rate), rate, pre_skip),
                         "pcm_s16le_cpu_us_per_audio_s": round(pcm_cpu / seconds * 1e6)})
    return rows


def thread_rows(samples: np.ndarray, thread_counts: list[int], complexity: int, bitrate: int) -> list[dict]:
    """Audio seconds encoded per wall second with N threads, each encoding the whole signal once: through
    StreamEncoder (what the gateway runs), and libopus's encode call alone (is the GIL released around it?)."""
    fmt = AudioFormat("opus", MODEL_SAMPLE_RATE, 20, bitrate)
    packets = [p.tobytes() for p in np.split(to_int16(samples[: len(samples) // 480 * 480]), len(samples) // 480)]

    def stream_encoder() -> None:
        encode_stream(samples, fmt, complexity)

    def opus_only() -> None:
        encoder = StreamEncoder(fmt, complexity=complexity)._opus
        for packet in packets:
            encoder.encode(packet, 480)

    rows, base = [], {}
    seconds = len(samples) / MODEL_SAMPLE_RATE
    for count in thread_counts:
        row = {"threads": count, "loadavg_1m_before": round(os.getloadavg()[0], 2)}
        for name, work in (("stream_encoder", stream_encoder), ("opus_encode_only", opus_only)):
            cpu = [0.0] * count

            def timed(index: int, work=work, cpu=cpu) -> None:
                started = time.thread_time()
                work()
                cpu[index] = time.thread_time() - started

            threads = [threading.Thread(target=timed, args=(index,)) for index in range(count)]
            started = time.perf_counter()
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            wall = time.perf_counter() - started
            rate = count * seconds / wall
            base.setdefault(name, rate)
            row[f"{name}_audio_s_per_wall_s"] = round(rate, 1)
            row[f"{name}_speedup"] = round(rate / base[name], 2)
            # cores busy at once: above 1 only if the threads ran together, outside the GIL (other load lowers it)
            row[f"{name}_cores_used"] = round(sum(cpu) / wall, 2)
        rows.append(row)
    return rows


def gil_probe(samples: np.ndarray, seconds: float = 1.0) -> dict[str, dict[str, float]]:
    """Does a thread in libopus let the others run? A probe thread sleeps 0.2 ms again and again while another thread
    works: its wake-ups per second and how late they come (ms, p50 / p95), beside nothing, beside libopus encoding
    60 ms packets at complexity 10 (~2 ms a call, the longest it makes), and beside sorting a list of floats (a C call
    that holds the GIL for ~3 ms: the control). Unlike the thread throughput it holds on a busy machine."""
    rate, size = 48000, 2880
    pcm = to_int16(soxr.resample(samples, MODEL_SAMPLE_RATE, rate, "HQ"))
    packets = [pcm[at:at + size].tobytes() for at in range(0, len(pcm) - size + 1, size)][:25]
    encoder = opuslib.Encoder(rate, 1, opuslib.APPLICATION_AUDIO)
    encoder.complexity, encoder.bitrate = 10, 24000
    floats = np.random.default_rng(0).random(20000).tolist()
    works = {"idle": lambda: time.sleep(0.01), "opus_encode": lambda: [encoder.encode(p, size) for p in packets],
             "gil_holding_sort": lambda: sorted(floats)}
    report = {}
    for name, work in works.items():
        stop, late = threading.Event(), []

        def probe(stop=stop, late=late) -> None:
            while not stop.is_set():
                started = time.perf_counter()
                time.sleep(0.0002)
                late.append(time.perf_counter() - started - 0.0002)

        thread = threading.Thread(target=probe)
        thread.start()
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            work()
        stop.set()
        thread.join()
        ms = np.array(late) * 1e3
        report[name] = {"wakeups_per_s": round(len(ms) / seconds), "late_ms_p50": round(float(np.percentile(ms, 50)), 3),
                        "late_ms_p95": round(float(np.percentile(ms, 95)), 3)}
    return report


def machine() -> dict:
    version = opuslib.api.libopus.opus_get_version_string
    version.restype = ctypes.c_char_p
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else ""
    return {"cpus": os.cpu_count(), "cpu": model, "libopus": version().decode(), "python": platform.python_version()}


def numbers(text: str) -> list[int]:
    return [int(value) for value in text.split(",") if value]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=20.0, help="of synthetic speech per measurement")
    parser.add_argument("--rates", type=numbers, default=[24000, 48000], help="Opus output rates")
    parser.add_argument("--complexities", type=numbers, default=list(range(11)), help="0..10")
    parser.add_argument("--modes", type=lambda text: text.split(","), default=list(OPUS_MODES),
                        help=f"Opus modes, comma-separated, of {', '.join(OPUS_MODES)}")
    parser.add_argument("--threads", type=numbers, default=[1, 2, 4], help="thread counts for the throughput")
    parser.add_argument("--thread-complexity", type=int, default=OPUS_COMPLEXITY,
                        help="complexity of the threaded runs (default: the gateway's)")
    parser.add_argument("--bitrate", type=int, default=AudioFormat().bitrate, help="bit/s (the protocol's default)")
    parser.add_argument("--repeats", type=int, default=3, help="cost runs per setting (the median counts)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if any(not 0 <= c <= 10 for c in args.complexities) or args.seconds <= 0 or args.repeats < 1:
        parser.error("complexities are 0..10; --seconds and --repeats must be positive")
    if not set(args.modes) <= set(OPUS_MODES):
        parser.error(f"--modes are of {', '.join(OPUS_MODES)}")
    samples = speech_like(args.seconds, seed=args.seed)
    report = {"machine": machine(), "seconds": args.seconds, "bitrate": args.bitrate, "frame_ms": 20,
              "gateway_complexity": OPUS_COMPLEXITY, "chunk_samples": CHUNK_SAMPLES,
              "cost": cost_rows(samples, args.rates, args.complexities, args.repeats, args.bitrate, args.modes),
              "threads": thread_rows(samples, args.threads, args.thread_complexity, args.bitrate),
              "gil": gil_probe(samples)}
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
