"""realtime/audio/ against real libopus, soxr and libsndfile: what a client decodes must be the model's audio,
whole (no lost tail), at the announced rate, in frames of the announced size."""
from __future__ import annotations

import io
import struct

import numpy as np
import opuslib_next as opuslib
import pytest
import soundfile
import soxr

from realtime.audio.encoders import StreamEncoder
from realtime.audio.files import encode_file, mp3_available
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
from realtime.audio.ogg import ogg_crc, ogg_opus

LENGTH = int(1.234 * MODEL_SAMPLE_RATE)  # not a whole number of frames at any rate


def sine(length: int = LENGTH, hz: float = 440.0, amplitude: float = 0.5) -> np.ndarray:
    t = np.arange(length) / MODEL_SAMPLE_RATE
    return (amplitude * np.sin(2 * np.pi * hz * t)).astype(np.float32)


def random_pieces(samples: np.ndarray, seed: int) -> list[np.ndarray]:
    """The samples cut at random points, empty pieces included, as a model's chunks arrive."""
    rng = np.random.default_rng(seed)
    cuts = np.sort(rng.integers(0, len(samples), size=40))
    return np.split(samples, cuts)


def stream(fmt: AudioFormat, pieces: list[np.ndarray]) -> tuple[StreamEncoder, list[EncodedFrame]]:
    encoder = StreamEncoder(fmt)
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
    assert encoder.pre_skip == rate * 13 // 2000  # libopus's 6.5 ms lookahead at this rate

    audio = np.concatenate(decoded).astype(np.float32)[encoder.pre_skip:] / 32768
    reference = resampled(samples, rate)
    assert len(audio) >= round(LENGTH * rate / MODEL_SAMPLE_RATE) == len(reference)
    assert len(audio) < len(reference) + encoder.pre_skip + size  # padding is at most one packet
    assert correlation(audio[:len(reference)], reference) > 0.9
    tail = rate // 100
    assert correlation(audio[len(reference) - tail:len(reference)], reference[-tail:]) > 0.9  # the tail came out
    assert rms(audio[len(reference):]) < 0.25 * rms(reference)  # then padding: silence, less the codec's noise


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

def reference_crc(data: bytes) -> int:
    """Bit by bit, unlike the module's table: CRC-32, polynomial 0x04C11DB7, MSB first, zero start, no xor out."""
    crc = 0
    for byte in data:
        crc ^= byte << 24
        for _ in range(8):
            crc = (crc << 1) ^ 0x04C11DB7 if crc & 0x80000000 else crc << 1
            crc &= 0xFFFFFFFF
    return crc


def parse_ogg(data: bytes) -> list[dict]:
    """Pages of an Ogg stream, each checked for its capture pattern and CRC, with its packets reassembled."""
    pages, offset = [], 0
    while offset < len(data):
        assert data[offset:offset + 4] == b"OggS"
        version, flags, granule, serial, sequence, crc, count = struct.unpack_from("<BBqIIIB", data, offset + 4)
        lacing = data[offset + 27:offset + 27 + count]
        end = offset + 27 + count + sum(lacing)
        raw = bytearray(data[offset:end])
        raw[22:26] = bytes(4)
        assert version == 0 and crc == reference_crc(bytes(raw))
        body, packets, packet = data[offset + 27 + count:end], [], b""
        for size in lacing:
            packet, body = packet + body[:size], body[size:]
            if size < 255:
                packets.append(packet)
                packet = b""
        assert packet == b""  # no packet continues onto the next page
        pages.append(dict(flags=flags, granule=granule, serial=serial, sequence=sequence, packets=packets))
        offset = end
    return pages


def test_ogg_crc_check_value() -> None:
    assert ogg_crc(b"123456789") == reference_crc(b"123456789") == 0x89A1897F


@pytest.mark.parametrize("rate", [8000, 24000, 48000])
def test_ogg_opus_structure(rate: int) -> None:
    samples = sine(MODEL_SAMPLE_RATE * 3 + 77)
    encoder, frames = stream(AudioFormat("opus", rate), [samples])
    total = round(len(samples) * rate / MODEL_SAMPLE_RATE)
    data = ogg_opus(frames, rate, encoder.pre_skip, total_samples=total)
    pages = parse_ogg(data)
    scale = 48000 // rate

    head, tags = pages[0]["packets"][0], pages[1]["packets"][0]
    assert pages[0]["flags"] == 0x02 and len(pages[0]["packets"]) == 1 and pages[0]["granule"] == 0
    assert struct.unpack("<8sBBHIhB", head) == (b"OpusHead", 1, 1, encoder.pre_skip * scale, rate, 0, 0)
    assert tags == b"OpusTags" + struct.pack("<I", 7) + b"voxgate" + struct.pack("<I", 0)
    assert pages[1]["granule"] == 0 and len(pages[1]["packets"]) == 1

    audio = pages[2:]
    assert len(audio) > 1  # three seconds take several pages
    assert [p["sequence"] for p in pages] == list(range(len(pages)))
    assert len({p["serial"] for p in pages}) == 1
    assert [p["flags"] for p in audio] == [0] * (len(audio) - 1) + [0x04]
    assert [packet for p in audio for packet in p["packets"]] == [f.payload for f in frames]
    granules = [p["granule"] for p in audio]
    assert granules == sorted(granules) and len(set(granules)) == len(granules)
    carried = 0
    for page in audio[:-1]:
        carried += len(page["packets"]) * frames[0].samples * scale
        assert page["granule"] == carried
    assert granules[-1] == (encoder.pre_skip + total) * scale
    untrimmed = parse_ogg(ogg_opus(frames, rate, encoder.pre_skip))
    assert untrimmed[-1]["granule"] == encoder.samples_out * scale


@pytest.mark.skipif("OPUS" not in soundfile.available_subtypes("OGG"), reason="libsndfile cannot read Ogg Opus")
@pytest.mark.parametrize("rate", [16000, 24000])
def test_ogg_opus_decodes_to_the_input_length(rate: int) -> None:
    samples = sine()
    encoder, frames = stream(AudioFormat("opus", rate), random_pieces(samples, seed=11))
    total = round(len(samples) * rate / MODEL_SAMPLE_RATE)
    audio, file_rate = soundfile.read(io.BytesIO(ogg_opus(frames, rate, encoder.pre_skip, total_samples=total)))
    assert file_rate == rate and len(audio) == total
    assert correlation(audio, resampled(samples, rate)) > 0.9


def test_ogg_opus_refuses_impossible_arguments() -> None:
    encoder, frames = stream(AudioFormat(), [sine()])
    with pytest.raises(ValueError, match="last packet"):
        ogg_opus(frames, 24000, encoder.pre_skip, total_samples=encoder.samples_out)  # more than it carries
    with pytest.raises(ValueError, match="last packet"):
        ogg_opus(frames, 24000, encoder.pre_skip, total_samples=LENGTH - 480)  # would cut whole packets
    with pytest.raises(ValueError, match="at least one packet"):
        ogg_opus([], 24000, 156)
    with pytest.raises(UnsupportedFormat, match="8000, 16000, 24000, 48000"):
        ogg_opus(frames, 22050, encoder.pre_skip)


# --- whole files -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("response_format, content_type", [("wav", "audio/wav"), ("flac", "audio/flac")])
def test_encode_file_lossless(response_format: str, content_type: str) -> None:
    samples = sine() * 2.5  # clipped, like pcm
    data, kind = encode_file(samples, response_format)
    assert kind == content_type
    info = soundfile.info(io.BytesIO(data))
    assert info.format == response_format.upper() and info.subtype == "PCM_16" and info.channels == 1
    audio, rate = soundfile.read(io.BytesIO(data), dtype="int16")
    assert rate == 24000 and np.array_equal(audio, to_int16(samples))


def test_encode_file_pcm() -> None:
    samples = sine()
    data, kind = encode_file(samples, "pcm")
    assert kind == "audio/pcm"
    assert np.array_equal(np.frombuffer(data, "<i2"), to_int16(samples))
    audio, _ = soundfile.read(io.BytesIO(data), samplerate=24000, channels=1, format="RAW", subtype="PCM_16",
                              endian="LITTLE", dtype="int16")
    assert np.array_equal(audio, to_int16(samples))


@pytest.mark.skipif("OPUS" not in soundfile.available_subtypes("OGG"), reason="libsndfile cannot read Ogg Opus")
@pytest.mark.parametrize("length", [LENGTH, 0])
def test_encode_file_opus(length: int) -> None:
    samples = sine(length)
    data, kind = encode_file(samples, "opus")
    assert kind == "audio/ogg" and data.startswith(b"OggS")
    audio, rate = soundfile.read(io.BytesIO(data))
    assert rate == 24000 and len(audio) == length
    if length:
        assert correlation(audio, samples) > 0.9


def test_encode_file_mp3_or_a_clear_refusal() -> None:
    samples = sine()
    if not mp3_available():
        with pytest.raises(UnsupportedFormat, match="mp3.*no encoder installed"):
            encode_file(samples, "mp3")
        return
    data, kind = encode_file(samples, "mp3")
    assert kind == "audio/mpeg"
    audio, rate = soundfile.read(io.BytesIO(data))
    assert rate == 24000 and len(samples) <= len(audio) < len(samples) + 24000 // 4


def test_encode_file_refuses_unknown_formats() -> None:
    assert HTTP_FORMATS == ("wav", "pcm", "opus", "flac", "mp3")
    with pytest.raises(UnsupportedFormat) as failure:
        encode_file(sine(), "aac")
    assert "'aac'" in str(failure.value) and "wav, pcm, opus, flac, mp3" in str(failure.value)
