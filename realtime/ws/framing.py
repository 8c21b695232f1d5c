"""One context's audio on the wire: encoded in the gateway's encoder processes into the session's format, and framed
as binary frames (PROTOCOL.md's header) or JSON `audio` events, with pts, FIRST / LAST / DISCONTINUITY flags and
sequence numbers continuous across the encoders a flush or mark restarts."""
from __future__ import annotations

import base64
import json
from collections.abc import Callable

import numpy as np

from realtime.audio.encoder_pool import EncoderPool
from realtime.audio.formats import MODEL_SAMPLE_RATE, AudioFormat, EncodedFrame
from realtime.ws.outbox import Outgoing
from realtime.ws.protocol import FLAG_DISCONTINUITY, FLAG_FIRST, FLAG_LAST, event, pack_header


class AudioFramer:
    def __init__(self, context_id: str, stream_id: int, fmt: AudioFormat, transport: str,
                 encoders: EncoderPool) -> None:
        self.context_id, self.stream_id = context_id, stream_id
        self.format, self.transport = fmt, transport
        self.encoders = encoders
        self.encoder = encoders.open(fmt)
        self.sent_first = False
        self.padding_s = 0.0  # silence the drained encoders added (a flush, a mark): later audio starts later
        self._seq = 0
        self._pts_base = 0  # output samples of the encoders before the current one
        self._discontinuity = False
        self._encoded_samples = 0  # synthesized samples given to the current encoder

    @property
    def samples_out(self) -> int:
        """Output samples framed so far, across encoders: the pts of the next frame."""
        return self._pts_base + self.encoder.samples_out

    async def encode(self, samples: np.ndarray) -> list[EncodedFrame]:
        """The frames these model samples complete, encoded in the encoder's process (the event loop keeps serving)."""
        frames = await self.encoder.encode(samples)
        self._encoded_samples += len(samples)
        return frames

    async def finish(self, whole_frame: bool = False) -> list[EncodedFrame]:
        """What the encoder still holds (Opus: its lookahead, the last packet padded; `whole_frame`: every
        encoding's last frame padded, as a flush needs)."""
        return await self.encoder.finish(whole_frame)

    def restart(self) -> None:
        """After a flush or mark drained the encoder (its frames framed): later audio starts a fresh encoder. For
        Opus its first frame is flagged DISCONTINUITY: a decoder resets and drops `pre_skip` samples again. A drain
        that gave out nothing leaves the timeline as it was (the drained encoder is replaced all the same: it is
        finished)."""
        if self.encoder.samples_out:
            self._pts_base += self.encoder.samples_out
            self.padding_s += (self.encoder.samples_out / self.format.sample_rate
                               - self._encoded_samples / MODEL_SAMPLE_RATE)
            self._encoded_samples = 0
            self._discontinuity = self.format.encoding == "opus"
        self.encoder.close()
        self.encoder = self.encoders.open(self.format, continuing=self.sent_first)

    def close(self) -> None:
        """The context is over: its encoder's state is freed (finished or not)."""
        self.encoder.close()

    def outgoing(self, frames: list[EncodedFrame], last: bool, on_first_sent: Callable[[], None]) -> Outgoing | None:
        """The frames as one outbox item, a message each in order (None for no frames); `last` flags the final one
        (an empty frame if all audio already went out). `on_first_sent` runs when the context's first frame leaves."""
        if last and not frames:
            frames = [EncodedFrame(b"", self.encoder.samples_out, 0)]
        if not frames:
            return None
        first = not self.sent_first
        messages = []
        for i, frame in enumerate(frames):
            flags = (FLAG_FIRST if first and i == 0 else 0) | (FLAG_LAST if last and i == len(frames) - 1 else 0)
            if self._discontinuity and frame.payload:
                flags |= FLAG_DISCONTINUITY
                self._discontinuity = False
            messages.append(self._payload(frame, self._pts_base + frame.pts, flags))
        self.sent_first = True
        rate_ms = self.format.sample_rate / 1000
        return Outgoing(messages, self.context_id, [frame.samples / rate_ms for frame in frames],
                        on_first_sent if first else None)

    def _payload(self, frame: EncodedFrame, pts: int, flags: int) -> str | bytes:
        if self.transport == "binary":
            return pack_header(flags, self.stream_id, pts) + frame.payload
        message = event("audio", context_id=self.context_id, seq=self._seq,
                        pts_ms=round(pts / self.format.sample_rate * 1000, 3),
                        duration_ms=round(frame.samples / self.format.sample_rate * 1000, 3),
                        data=base64.b64encode(frame.payload).decode("ascii"),
                        first=True if flags & FLAG_FIRST else None, last=True if flags & FLAG_LAST else None,
                        discontinuity=True if flags & FLAG_DISCONTINUITY else None)
        self._seq += 1
        return json.dumps(message)
