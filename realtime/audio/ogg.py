"""Ogg Opus (RFC 7845): a stream's Opus packets as a complete file."""
from __future__ import annotations

import struct

from realtime.audio.formats import OPUS_RATE, SAMPLE_RATES, EncodedFrame, UnsupportedFormat, listed

OGG_SERIAL = 0x766F7867  # one logical stream per file, so a fixed serial is valid and keeps files reproducible
OGG_PAGE_GRANULES = OPUS_RATE  # audio per page: about a second, like opusenc
OGG_BOS, OGG_EOS = 0x02, 0x04  # header-type flags: first and last page of the stream


def _ogg_crc_table() -> tuple[int, ...]:
    table = []
    for byte in range(256):
        crc = byte << 24
        for _ in range(8):
            crc = ((crc << 1) ^ 0x04C11DB7 if crc & 0x80000000 else crc << 1) & 0xFFFFFFFF
        table.append(crc)
    return tuple(table)


_OGG_CRC_TABLE = _ogg_crc_table()


def ogg_crc(data: bytes) -> int:
    """Ogg's page checksum: CRC-32, polynomial 0x04C11DB7, not reflected, zero start, no final xor."""
    crc = 0
    for byte in data:
        crc = ((crc << 8) & 0xFFFFFFFF) ^ _OGG_CRC_TABLE[(crc >> 24) ^ byte]
    return crc


def _lacing(packet: bytes) -> bytes:
    """A packet's segment-table entries: 255 per full segment, then the remainder (0 ends a multiple of 255)."""
    return bytes([255] * (len(packet) // 255) + [len(packet) % 255])


def _ogg_page(packets: list[bytes], flags: int, granule: int, sequence: int) -> bytes:
    segments = b"".join(_lacing(p) for p in packets)
    header = struct.pack("<4sBBqIIIB", b"OggS", 0, flags, granule, OGG_SERIAL, sequence, 0, len(segments))
    page = header + segments + b"".join(packets)
    return page[:22] + struct.pack("<I", ogg_crc(page)) + page[26:]


def _opus_head(sample_rate: int, pre_skip_48k: int) -> bytes:
    return struct.pack("<8sBBHIhB", b"OpusHead", 1, 1, pre_skip_48k, sample_rate, 0, 0)


def _opus_tags() -> bytes:
    vendor = b"voxgate"
    return b"OpusTags" + struct.pack("<I", len(vendor)) + vendor + struct.pack("<I", 0)


def _audio_pages(frames: list[EncodedFrame], scale: int) -> list[tuple[list[bytes], int]]:
    """Packets grouped into pages of about a second (never over 255 segments), each with its end in 48 kHz units
    counted from the first decoded sample."""
    pages: list[tuple[list[bytes], int]] = []
    packets: list[bytes] = []
    segments = start = end = 0
    for frame in frames:
        laced = len(frame.payload) // 255 + 1
        if packets and (segments + laced > 255 or end - start >= OGG_PAGE_GRANULES):
            pages.append((packets, end))
            packets, segments, start = [], 0, end
        packets.append(frame.payload)
        segments += laced
        end += frame.samples * scale
    if packets:
        pages.append((packets, end))
    return pages


def _final_granule(frames: list[EncodedFrame], scale: int, pre_skip: int, total_samples: int | None) -> int:
    """Where decoding stops: all audio carried, or exactly pre_skip + total_samples, which must end inside the
    last packet (so no page's granule goes backwards)."""
    carried = sum(f.samples for f in frames)
    if total_samples is None:
        return carried * scale
    end = pre_skip + total_samples
    if not carried - frames[-1].samples < end <= carried:
        raise ValueError(f"total_samples {total_samples} must end inside the last packet: above "
                         f"{carried - frames[-1].samples - pre_skip}, at most {carried - pre_skip}")
    return end * scale


def ogg_opus(frames: list[EncodedFrame], sample_rate: int, pre_skip: int, total_samples: int | None = None) -> bytes:
    """A complete Ogg Opus file of one stream's packets. `pre_skip` and `total_samples` are at `sample_rate`; with
    `total_samples` the last granule trims the final packet's padding exactly."""
    if sample_rate not in SAMPLE_RATES["opus"]:
        raise UnsupportedFormat(f"Ogg Opus needs an Opus sample rate; allowed: {listed(SAMPLE_RATES['opus'])}")
    scale = OPUS_RATE // sample_rate
    if not frames:
        raise ValueError("an Ogg Opus stream needs at least one packet")
    out = [_ogg_page([_opus_head(sample_rate, pre_skip * scale)], OGG_BOS, 0, 0), _ogg_page([_opus_tags()], 0, 0, 1)]
    pages = _audio_pages(frames, scale)
    for index, (packets, end) in enumerate(pages):
        last = index == len(pages) - 1
        granule = _final_granule(frames, scale, pre_skip, total_samples) if last else end
        out.append(_ogg_page(packets, OGG_EOS if last else 0, granule, index + 2))
    return b"".join(out)
