"""realtime/audio/ against real libopus, soxr and libsndfile: what a client decodes must be the model's audio,
whole (no lost tail), at the announced rate, in frames of the announced size."""
from __future__ import annotations

import asyncio
import io
import json
import struct

import av
import numpy as np
import opuslib_next as opuslib
import pytest
import soundfile
import soxr

from realtime.audio import containers
from realtime.audio.containers import body_encoder, format_available, whole_file
from realtime.audio.encoders import OPUS_COMPLEXITY, OPUS_MODES, StreamEncoder, opus_mode, pre_skip
from realtime.audio.formats import (
    DEFAULT_RATES,
    HTTP_FORMATS,
    MODEL_SAMPLE_RATE,
    SAMPLE_RATES,
    AudioFormat,
    EncodedFrame,
    UnsupportedFormat,
    to_int16,
)
from realtime.audio.mulaw import mulaw_decode, mulaw_encode
from realtime.ws.framing import AudioFramer
from realtime.ws.protocol import FLAG_DISCONTINUITY
from scripts.bench_opus import quality, speech_like
from tests.test_encoder_pool import running_pool

LENGTH = int(1.234 * MODEL_SAMPLE_RATE)  # not a whole number of frames at any rate


def sine(length: int = LENGTH, hz: float = 440.0, amplitude: float = 0.5) -> np.ndarray:
    t = np.arange(length) / MODEL_SAMPLE_RATE
    return (amplitude * np.sin(2 * np.pi * hz * t)).astype(np.float32)


def random_pieces(samples: np.ndarray, seed: int) -> list[np.ndarray]:
    """The samples cut at random points, empty pieces included, as a model's chunks arrive."""
    rng = np.random.default_rng(seed)
    cuts = np.sort(rng.integers(0, len(samples), size=40))
    return np.split(samples, cuts)


def stream(fmt: AudioFormat, pieces: list[np.ndarray],
           mode: str | None = None) -> tuple[StreamEncoder, list[EncodedFrame]]:
    encoder = StreamEncoder(fmt, mode=mode)
    frames = [frame for piece in pieces for frame in encoder.encode(piece)]
    return encoder, frames + encoder.finish()


def resampled(samples: np.ndarray, rate: int) -> np.ndarray:
    return samples if rate == MODEL_SAMPLE_RATE else soxr.resample(samples, MODEL_SAMPLE_RATE, rate, "HQ")


def correlation(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.corrcoef(a, b)[0, 1])


def rms(samples: np.ndarray) -> float:
    return float(np.sqrt(np.mean(np.square(samples))))


def decode_opus(frames: list[EncodedFrame], rate: int) -> list[np.ndarray]:
    decoder = opuslib.Decoder(rate, 1)
    return [np.frombuffer(decoder.decode(f.payload, rate * 120 // 1000), "<i2") for f in frames]


# --- formats ---------------------------------------------------------------------------------------------------

def test_defaults_and_frame_sizes() -> None:
    assert AudioFormat().check() == AudioFormat("opus", 24000, 20, 24000)
    assert DEFAULT_RATES == {"opus": 24000, "pcm_s16le": 24000, "mulaw": 8000}
    assert AudioFormat().frame_samples == 480
    assert AudioFormat("mulaw", 8000).frame_samples == 160
    assert AudioFormat("pcm_s16le", 22050, 20).frame_samples == 441
    assert AudioFormat("opus", 48000, 60).frame_samples == 2880


@pytest.mark.parametrize("fmt, words", [
    (AudioFormat("aac"), ("'aac'", "opus, pcm_s16le, mulaw")),
    (AudioFormat("opus", 22050), ("opus", "22050", "8000, 16000, 24000, 48000")),
    (AudioFormat("mulaw", 16000), ("mulaw", "16000", "allowed: 8000")),
    (AudioFormat("opus", 24000, 30), ("frame_ms 30", "10, 20, 40, 60")),
    (AudioFormat("pcm_s16le", 24000, 15), ("frame_ms 15", "10, 20, 30")),
    (AudioFormat("pcm_s16le", 24000, 110), ("frame_ms 110", "100")),
    (AudioFormat("mulaw", 8000, 40), ("mulaw does not support frame_ms 40", "allowed: 20")),
    (AudioFormat("opus", bitrate=5999), ("bitrate 5999", "6000 to 128000")),
    (AudioFormat("opus", bitrate=128001), ("bitrate 128001", "6000 to 128000")),
])
def test_check_refuses_with_a_precise_message(fmt: AudioFormat, words: tuple[str, ...]) -> None:
    with pytest.raises(UnsupportedFormat) as failure:
        fmt.check()
    assert all(word in str(failure.value) for word in words), str(failure.value)
    with pytest.raises(UnsupportedFormat):
        StreamEncoder(fmt)


def test_check_accepts_every_listed_rate_and_ignores_bitrate_outside_opus() -> None:
    for encoding, rates in SAMPLE_RATES.items():
        for rate in rates:
            fmt = AudioFormat(encoding, rate)
            assert fmt.check() is fmt
    assert AudioFormat("pcm_s16le", 24000, 100, bitrate=1).check().frame_ms == 100


def test_to_int16_clips_and_rounds() -> None:
    values = to_int16(np.array([0.0, 0.5, -0.5, 1.0, -1.0, 1.5, -2.0, 1e-5], np.float32))
    assert values.dtype == np.int16
    assert values.tolist() == [0, 16384, -16384, 32767, -32767, 32767, -32767, 0]


# --- opus ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("rate, frame_ms", [(r, 20) for r in SAMPLE_RATES["opus"]] + [(24000, 10), (16000, 40),
                                                                                       (48000, 60)])
def test_opus_stream_decodes_to_the_whole_input(rate: int, frame_ms: int) -> None:
    fmt = AudioFormat("opus", rate, frame_ms)
    samples = sine()
    encoder, frames = stream(fmt, random_pieces(samples, seed=rate + frame_ms))
    size = fmt.frame_samples
    decoded = decode_opus(frames, rate)
    assert [len(packet) for packet in decoded] == [size] * len(frames)
    assert [f.samples for f in frames] == [size] * len(frames)
    assert [f.pts for f in frames] == [i * size for i in range(len(frames))]
    assert encoder.samples_out == sum(f.samples for f in frames)
    assert encoder.pre_skip == LOOKAHEAD_MS[opus_mode(fmt)] * rate // 1000  # libopus's lookahead in the format's mode

    audio = np.concatenate(decoded).astype(np.float32)[encoder.pre_skip:] / 32768
    reference = resampled(samples, rate)
    assert len(audio) >= round(LENGTH * rate / MODEL_SAMPLE_RATE) == len(reference)
    assert len(audio) < len(reference) + encoder.pre_skip + size  # padding is at most one packet
    assert correlation(audio[:len(reference)], reference) > 0.9
    tail = rate // 100
    assert correlation(audio[len(reference) - tail:len(reference)], reference[-tail:]) > 0.9  # the tail came out
    assert rms(audio[len(reference):]) < 0.25 * rms(reference)  # then padding: silence, less the codec's noise


LOOKAHEAD_MS = {"celt": 2.5, "speech": 6.5}


@pytest.mark.parametrize("rate, bitrate, mode", [(8000, 24000, "speech"), (16000, 24000, "speech"),
                                                 (24000, 24000, "celt"), (48000, 64000, "celt"),
                                                 (24000, 16000, "celt"), (24000, 12000, "speech"),
                                                 (48000, 6000, "speech")])
def test_opus_mode_follows_the_rate_and_bitrate(rate: int, bitrate: int, mode: str) -> None:
    """CELT alone where it is the cheaper coder at a small cost (24, 48 kHz from 16 kbit/s), SILK's speech modes where
    they are the better coder (8, 16 kHz; low bitrates); the mode shows in the lookahead, which session.started gives
    as pre_skip."""
    assert opus_mode(AudioFormat("opus", rate, 20, bitrate)) == mode
    assert StreamEncoder(AudioFormat("opus", rate, 20, bitrate)).pre_skip == LOOKAHEAD_MS[mode] * rate // 1000
    assert pre_skip(AudioFormat("opus", rate, 20, bitrate)) == LOOKAHEAD_MS[mode] * rate // 1000  # what a session says
    assert pre_skip(AudioFormat("pcm_s16le", rate)) == pre_skip(AudioFormat("mulaw", 8000)) == 0
    for each in OPUS_MODES:
        encoder = StreamEncoder(AudioFormat("opus", rate), mode=each)
        assert encoder.pre_skip == LOOKAHEAD_MS[each] * rate // 1000
    with pytest.raises(ValueError, match="unknown Opus mode"):
        StreamEncoder(AudioFormat("opus", rate), mode="silk")


def test_opus_lookahead_drain_is_what_saves_the_tail() -> None:
    """A stream that ends exactly on a packet boundary still needs a packet more: the last pre_skip samples."""
    encoder = StreamEncoder(AudioFormat())
    frames = encoder.encode(sine(480 * 10))
    assert len(frames) == 10
    tail = encoder.finish()
    assert len(tail) == 1 and tail[0].pts == 4800 and tail[0].samples == 480
    audio = np.concatenate(decode_opus(frames + tail, 24000)).astype(np.float32)[encoder.pre_skip:] / 32768
    assert correlation(audio[4800 - 240:4800], sine(4800)[-240:]) > 0.9


def test_opus_packets_follow_the_bitrate() -> None:
    samples = sine(24000 * 2)
    sizes = {}
    for bitrate in (6000, 64000):
        _, frames = stream(AudioFormat(bitrate=bitrate), [samples])
        sizes[bitrate] = sum(len(f.payload) for f in frames) * 8 / 2  # bit/s
    assert sizes[6000] < 12000 < 32000 < sizes[64000]


# speech through the gateway's Opus at 24 kbit/s keeps at least this (complexity 5, 24 kHz: CELT ~19.3 dB and
# 6.0-6.5 dB over speech_like's seeds, the speech modes ~19.0 dB and ~5.7 dB; at 12 kbit/s CELT ~14.2 dB and
# ~7.2 dB, the speech modes ~13.9 dB and ~8.2 dB; scripts/bench_opus.py)
SPEECH_SNR_FLOOR_DB = 17.0
SPEECH_LSD_CEILING_DB = 6.8


def test_opus_encodes_at_the_gateways_complexity():
    """The chosen complexity (docs/benchmarks.md, "Opus encoder cost per stream (CPU)"), not libopus's default 9."""
    assert OPUS_COMPLEXITY == 5
    assert StreamEncoder(AudioFormat())._opus.complexity == OPUS_COMPLEXITY
    assert StreamEncoder(AudioFormat("opus", 48000), complexity=10)._opus.complexity == 10


@pytest.mark.parametrize("rate, mode", [(24000, None), (48000, None), (24000, "speech")])
def test_speech_keeps_its_quality_at_the_gateways_complexity(rate: int, mode: str | None) -> None:
    """Synthetic speech decodes above the quality floor, in the gateway's mode at the default bitrate and in the
    other; the floor means something: the same speech in the same mode at 12 kbit/s falls below it."""
    speech = speech_like(3.0)
    mode = mode or opus_mode(AudioFormat("opus", rate))

    def scores(bitrate: int) -> dict[str, float]:
        encoder, frames = stream(AudioFormat("opus", rate, 20, bitrate), random_pieces(speech, seed=rate), mode)
        decoded = np.concatenate(decode_opus(frames, rate)).astype(np.float32) / 32768
        return quality(speech, decoded, rate, encoder.pre_skip)

    kept = scores(24000)
    assert kept["snr_db"] > SPEECH_SNR_FLOOR_DB and kept["lsd_db"] < SPEECH_LSD_CEILING_DB, kept
    starved = scores(12000)
    assert starved["snr_db"] < SPEECH_SNR_FLOOR_DB and starved["lsd_db"] > SPEECH_LSD_CEILING_DB, starved


# --- pcm and mu-law --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("rate", SAMPLE_RATES["pcm_s16le"])
def test_pcm_at_every_rate(rate: int) -> None:
    fmt = AudioFormat("pcm_s16le", rate, 30)
    samples = sine()
    encoder, frames = stream(fmt, random_pieces(samples, seed=rate))
    expected = round(LENGTH * rate / MODEL_SAMPLE_RATE)
    assert abs(encoder.samples_out - expected) <= 1
    assert encoder.pre_skip == 0
    assert all(len(f.payload) == fmt.frame_samples * 2 for f in frames[:-1])
    assert 0 < len(frames[-1].payload) <= fmt.frame_samples * 2
    assert [f.samples * 2 for f in frames] == [len(f.payload) for f in frames]
    assert [f.pts for f in frames] == [i * fmt.frame_samples for i in range(len(frames))]

    pcm = np.frombuffer(b"".join(f.payload for f in frames), "<i2").astype(np.int32)
    reference = to_int16(resampled(samples, rate)).astype(np.int32)
    assert len(pcm) == len(reference)
    assert np.abs(pcm - reference).max() <= 1


def test_mulaw_stream() -> None:
    fmt = AudioFormat("mulaw", 8000)
    samples = sine()
    encoder, frames = stream(fmt, random_pieces(samples, seed=7))
    assert all(len(f.payload) == 160 for f in frames[:-1])
    assert 0 < len(frames[-1].payload) <= 160
    assert encoder.samples_out == sum(len(f.payload) for f in frames) == round(LENGTH / 3)
    decoded = mulaw_decode(b"".join(f.payload for f in frames)).astype(np.float32) / 32768
    assert correlation(decoded, resampled(samples, 8000)) > 0.999


def test_mulaw_known_values() -> None:
    pcm = np.array([0, 32767, -32768, 1000, -1000, 4, -4, 200], np.int16)
    assert mulaw_encode(pcm).hex() == "ff8000ce4efe7eeb"
    assert mulaw_decode(bytes([0xFF, 0x7F, 0x80, 0x00, 0xCE, 0x4E])).tolist() == [0, 0, 32124, -32124, 988, -988]
    codes = bytes(c for c in range(256) if c != 0x7F)  # 0x7F is minus zero: it encodes back as 0xFF
    assert mulaw_encode(mulaw_decode(codes)) == codes


def test_mulaw_round_trip_error_is_within_the_quantizer_step() -> None:
    pcm = np.arange(-32768, 32768, dtype=np.int16)
    decoded = mulaw_decode(mulaw_encode(pcm)).astype(np.int32)
    magnitude = np.abs(pcm.astype(np.int32))
    inside = magnitude <= 32635  # beyond it G.711 clips to its largest code
    error = np.abs(decoded - pcm)
    assert (error[inside] <= (magnitude[inside] + 132) / 32 + 1).all()
    assert (np.sign(decoded[magnitude > 100]) == np.sign(pcm[magnitude > 100])).all()
    assert error[~inside].max() <= 32768 - 32124


@pytest.mark.parametrize("fmt", [AudioFormat("pcm_s16le", 24000), AudioFormat("pcm_s16le", 44100, 10),
                                 AudioFormat("mulaw", 8000), AudioFormat("opus", 16000),
                                 AudioFormat("opus", 24000, 40)])
def test_splitting_does_not_change_the_output(fmt: AudioFormat) -> None:
    samples = sine()
    _, whole = stream(fmt, [samples])
    _, pieces = stream(fmt, random_pieces(samples, seed=3))
    _, single = stream(fmt, [samples[i:i + 1] for i in range(len(samples))][:2000] + [samples[2000:]])
    assert len(whole) == len(pieces) == len(single)
    assert [f.pts for f in whole] == [f.pts for f in pieces] == [f.pts for f in single]
    assert b"".join(f.payload for f in whole) == b"".join(f.payload for f in pieces) == b"".join(
        f.payload for f in single)


@pytest.mark.parametrize("encoding", ["opus", "pcm_s16le", "mulaw"])
def test_finish_edge_cases(encoding: str) -> None:
    fmt = AudioFormat(encoding, DEFAULT_RATES[encoding])
    encoder = StreamEncoder(fmt)
    assert encoder.encode(np.zeros(0, np.float32)) == []
    assert encoder.finish() == []  # no audio at all: nothing to send
    assert encoder.finish() == []
    with pytest.raises(RuntimeError):
        encoder.encode(sine(100))

    encoder = StreamEncoder(fmt)
    assert encoder.encode(sine(100)) == []  # less than a frame waits
    last = encoder.finish()
    assert len(last) == 1 and last[0].pts == 0
    assert encoder.finish() == [] and encoder.samples_out == last[0].samples


# --- Ogg Opus --------------------------------------------------------------------------------------------------

# --- the speech endpoint's bodies (realtime/audio/containers.py, PyAV) --------------------------------------------
# decoded by FFmpeg's decoders through PyAV, and by libsndfile where it reads the format

CONTAINER_FORMATS = ("wav", "flac", "mp3", "aac", "opus")
# how far a streamed body's decodable audio may run behind what went in, in samples at 24 kHz: a FLAC block, a held
# 20 ms Opus packet, the MP3 and AAC encoders' frames and lookahead (AAC counted with its 1024 priming samples)
STREAM_LAG = {"pcm": 0, "wav": 0, "flac": 960, "opus": 960, "mp3": 4 * 576, "aac": 2 * 1024}
# decoded length minus the audio that went in: ADTS cannot mark AAC's priming, nor a stream MP3's (a whole MP3 says
# it in its Xing/LAME frame); each also pads its last frame
EXTRA = {"aac": (1024, 1024 + 1023), "mp3": (0, 1152 + 576 + 575)}


def encode_body(response_format: str, streamed: bool, pieces: list[np.ndarray]) -> tuple[list[bytes], int]:
    """Streamed: the bytes each call returned; whole: the file the calls wrote (they return nothing)."""
    into = None if streamed else whole_file()
    encoder = body_encoder(response_format, into)
    parts = [encoder.encode(piece) for piece in pieces] + [encoder.finish()]
    if into is not None:
        assert parts == [b""] * len(parts)
        into.seek(0)
        parts = [into.read()]
        into.close()
    return parts, encoder.samples


def decode_body(data: bytes) -> tuple[np.ndarray, int]:
    """Mono float32 and its rate, by FFmpeg's decoder (Opus decodes at 48 kHz)."""
    with av.open(io.BytesIO(data)) as container:
        frames = [frame.to_ndarray().reshape(-1) for frame in container.decode(audio=0)]
        rate = container.streams.audio[0].rate
    audio = np.concatenate(frames) if frames else np.zeros(0, np.float32)
    return (audio / 32768.0 if audio.dtype == np.int16 else audio).astype(np.float32), rate


def length_at_24k(audio: np.ndarray, rate: int) -> int:
    return len(audio) * MODEL_SAMPLE_RATE // rate


def aligned_correlation(audio: np.ndarray, samples: np.ndarray, max_shift: int) -> float:
    """The best correlation of `samples` with `audio` delayed by up to `max_shift` samples (a codec's priming)."""
    n = len(samples) - max_shift
    return max(correlation(audio[shift:shift + n], samples[:n]) for shift in range(0, max_shift + 1, 4))


@pytest.mark.parametrize("streamed", [True, False], ids=["streamed", "whole"])
@pytest.mark.parametrize("response_format", CONTAINER_FORMATS)
def test_a_body_decodes_to_the_audio_that_went_in(response_format: str, streamed: bool) -> None:
    samples = sine(MODEL_SAMPLE_RATE * 2 + 77)
    parts, taken = encode_body(response_format, streamed, random_pieces(samples, seed=5))
    audio, rate = decode_body(b"".join(parts))
    primed = response_format == "aac" or response_format == "mp3" and streamed
    low, high = EXTRA[response_format] if primed else (0, 0)
    assert taken == len(samples) and len(samples) + low <= length_at_24k(audio, rate) <= len(samples) + high
    at_24k = audio if rate == MODEL_SAMPLE_RATE else soxr.resample(audio, rate, MODEL_SAMPLE_RATE)
    assert aligned_correlation(at_24k, samples, high) > 0.9


@pytest.mark.parametrize("response_format", ["wav", "flac"])
def test_lossless_bodies_carry_the_pcm_exactly(response_format: str) -> None:
    samples = sine() * 2.5  # clipped, as pcm is
    for streamed in (True, False):
        parts, _ = encode_body(response_format, streamed, random_pieces(samples, seed=2))
        audio, _ = decode_body(b"".join(parts))
        assert np.array_equal(np.rint(audio * 32768).astype(np.int16), to_int16(samples)), streamed


@pytest.mark.parametrize("response_format", ("pcm", *CONTAINER_FORMATS))
def test_a_whole_body_goes_to_disk_past_its_memory_bound(response_format: str) -> None:
    """A long whole body (up to max_text_chars of speech) is not held in memory while it is made: its file rolls to
    disk past WHOLE_IN_MEMORY_BYTES, and the body read back is the one made in memory."""
    samples = sine(MODEL_SAMPLE_RATE * 30)  # 30 s: 1.44 MB of PCM, ~0.1-1 MB in the lossy formats
    in_memory = b"".join(encode_body(response_format, False, [samples])[0])
    bound = len(in_memory) // 3
    assert bound > 1000
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(containers, "WHOLE_IN_MEMORY_BYTES", bound)
        into = whole_file()
        encoder = body_encoder(response_format, into)
        for start in range(0, len(samples), 1920):
            encoder.encode(samples[start:start + 1920])
        encoder.finish()
    assert into._rolled  # SpooledTemporaryFile's own flag: the bytes are in a file on disk now
    into.seek(0)
    assert into.read() == in_memory
    into.close()


def test_pcm_is_s16le_as_it_comes() -> None:
    samples = sine()
    parts, taken = encode_body("pcm", True, random_pieces(samples, seed=4))
    assert parts[-1] == b"" and taken == len(samples)
    assert np.array_equal(np.frombuffer(b"".join(parts), "<i2"), to_int16(samples))


@pytest.mark.parametrize("response_format", ("pcm", *CONTAINER_FORMATS))
def test_a_streamed_body_is_decodable_as_the_audio_comes(response_format: str) -> None:
    """After each 80 ms chunk (the engine's chunk at 12.5 Hz) the bytes out so far decode to all but a codec's
    frame or two of what went in: the body is sent as it is made, not held to the end."""
    samples, chunk = sine(MODEL_SAMPLE_RATE), 1920
    encoder, sent = body_encoder(response_format), b""
    behind = []
    for start in range(0, len(samples), chunk):
        sent += encoder.encode(samples[start:start + chunk])
        if response_format == "pcm":
            decoded = len(sent) // 2
        else:
            try:
                decoded = length_at_24k(*decode_body(sent))
            except av.error.InvalidDataError:  # nothing whole yet: only the first chunk of MP3 and AAC
                decoded = 0
        behind.append(min(start + chunk, len(samples)) - decoded)
    assert max(behind[2:]) <= STREAM_LAG[response_format], behind
    assert behind[0] == 0 if response_format in ("pcm", "wav", "flac") else behind[0] <= chunk


def test_streamed_and_whole_headers() -> None:
    """Streamed, a header says "length unknown" (as FFmpeg writes it to a pipe); whole, it has the exact length."""
    samples = sine()
    streamed = b"".join(encode_body("wav", True, [samples])[0])
    whole = b"".join(encode_body("wav", False, [samples])[0])
    assert streamed[:4] == whole[:4] == b"RIFF" and streamed[36:40] == whole[36:40] == b"data"
    assert struct.unpack("<I", streamed[4:8])[0] == struct.unpack("<I", streamed[40:44])[0] == 0xFFFFFFFF
    assert struct.unpack("<I", whole[40:44])[0] == 2 * len(samples) and len(whole) == 44 + 2 * len(samples)
    assert struct.unpack("<I", whole[4:8])[0] == len(whole) - 8
    audio, rate = soundfile.read(io.BytesIO(streamed), dtype="int16")  # libsndfile reads the unknown sizes too
    assert rate == 24000 and np.array_equal(audio, to_int16(samples))
    flac_total = {streamed: soundfile.info(io.BytesIO(b"".join(encode_body("flac", False, [samples])[0]))).frames}
    assert list(flac_total.values()) == [len(samples)]
    flac_streamed = b"".join(encode_body("flac", True, [samples])[0])
    streaminfo_total = int.from_bytes(flac_streamed[8 + 10:8 + 18], "big") & (2**36 - 1)
    assert flac_streamed[:4] == b"fLaC" and streaminfo_total == 0  # "unknown"


@pytest.mark.skipif("OPUS" not in soundfile.available_subtypes("OGG"), reason="libsndfile cannot read Ogg Opus")
@pytest.mark.parametrize("streamed", [True, False])
def test_ogg_opus_read_by_libsndfile_too(streamed: bool) -> None:
    samples = sine()
    data = b"".join(encode_body("opus", streamed, random_pieces(samples, seed=9))[0])
    audio, rate = soundfile.read(io.BytesIO(data))
    assert data[:4] == b"OggS" and rate == 24000 and len(audio) == len(samples)
    assert correlation(audio, samples) > 0.9


@pytest.mark.parametrize("response_format", CONTAINER_FORMATS)
def test_the_bytes_do_not_depend_on_how_the_audio_was_cut(response_format: str) -> None:
    samples = sine()
    whole_pieces = b"".join(encode_body(response_format, True, [samples])[0])
    assert b"".join(encode_body(response_format, True, random_pieces(samples, seed=8))[0]) == whole_pieces


def test_every_openai_format_is_offered() -> None:
    assert HTTP_FORMATS == ("wav", "pcm", "opus", "flac", "mp3", "aac")
    assert all(format_available(name) for name in HTTP_FORMATS) and not format_available("ogg")


@pytest.mark.parametrize("transport", ["binary", "json"])
def test_a_fresh_encoder_after_a_flush_is_flagged_in_either_transport(transport):
    """After a flush drained the Opus encoder, the next frame starts a new stream: a client resets its decoder and
    drops pre_skip again. The binary header flags it DISCONTINUITY; a JSON audio event says `discontinuity`."""
    async def frames_around_a_flush():
        async with running_pool(1) as pool:
            framer = AudioFramer("c", 7, AudioFormat(), transport, pool)
            speech = speech_like(0.2, MODEL_SAMPLE_RATE)
            before = framer.outgoing(await framer.encode(speech), last=False, on_first_sent=lambda: None).messages
            before += framer.outgoing(await framer.finish(), last=False, on_first_sent=lambda: None).messages
            framer.restart()
            after = framer.outgoing(await framer.encode(speech), last=False, on_first_sent=lambda: None)
            return before, after.messages

    before, after = asyncio.run(frames_around_a_flush())

    def discontinuity(message) -> bool:
        if transport == "binary":
            return bool(message[1] & FLAG_DISCONTINUITY)
        return json.loads(message).get("discontinuity") is True

    assert not any(map(discontinuity, before)) and discontinuity(after[0]) and not any(map(discontinuity, after[1:]))


def test_a_drain_before_any_audio_leaves_the_timeline_and_a_working_encoder():
    """A flush or mark before the context's first audio drains an encoder that gave out nothing: the next audio
    still encodes (from a fresh encoder), starts at pts 0 and is not flagged as a discontinuity."""
    async def go():
        async with running_pool(1) as pool:
            framer = AudioFramer("c", 1, AudioFormat(), "binary", pool)
            assert await framer.finish(whole_frame=True) == []
            framer.restart()
            frames = await framer.encode(speech_like(0.2, MODEL_SAMPLE_RATE))
            return frames, framer.outgoing(frames, last=False, on_first_sent=lambda: None).messages

    frames, messages = asyncio.run(go())
    assert frames and frames[0].pts == 0
    assert not any(message[1] & FLAG_DISCONTINUITY for message in messages)


def test_a_bitrate_another_encoding_ignored_does_not_follow_into_opus() -> None:
    """A hostile try: pcm with bitrate 1 was taken (pcm ignores it), and a later switch to opus failed on a field that
    message never sent. Switching without a bitrate takes opus's default; one given out of range is still refused."""
    from realtime.ws.protocol import SessionConfig, configure

    config, refused = configure(SessionConfig(), {"audio": {"encoding": "pcm_s16le", "bitrate": 1}})
    assert not refused and config.audio.encoding == "pcm_s16le"
    config, refused = configure(config, {"audio": {"encoding": "opus"}})
    assert not refused and (config.audio.encoding, config.audio.bitrate) == ("opus", AudioFormat().bitrate)
    _, refused = configure(config, {"audio": {"encoding": "opus", "bitrate": 1}})
    assert [failure.code for failure in refused] == ["unsupported_format"] and "bitrate 1" in refused[0].message
    config, refused = configure(SessionConfig(), {"audio": {"bitrate": 32000}})
    config, refused = configure(config, {"audio": {"encoding": "opus", "sample_rate": 48000}})
    assert not refused and config.audio.bitrate == 32000  # one in range is kept


@pytest.mark.parametrize("fields", [
    {"audio": {"encoding": None}}, {"audio": {"frame_ms": None}}, {"audio": {"sample_rate": None}},
    {"audio": {"bitrate": None}}, {"text": {"buffering": None}}, {"text": {"max_buffer_delay_ms": None}},
    {"transport": {"audio": None}},
], ids=lambda fields: ".".join(f"{k}.{next(iter(v))}" for k, v in fields.items()))
def test_a_null_config_field_is_not_given(fields):
    """Null means "not given" in every field of session.start (a client serialising its unset options as null):
    the value before stays. `frame_ms`, `encoding`, `buffering`, the delay and `transport.audio` refused it."""
    from realtime.ws.protocol import SessionConfig, configure

    before, _ = configure(SessionConfig(), {"audio": {"encoding": "pcm_s16le", "frame_ms": 40},
                                            "text": {"buffering": "none"}, "transport": {"audio": "json"}})
    after, refused = configure(before, fields)
    assert not refused and after == before
