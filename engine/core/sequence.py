"""One request inside the engine: its prompt, text track, progress and end, from submit to its Finished event."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from engine.errors import VoxgateError
from engine.prompt import Prompt
from engine.request import SynthesisRequest
from engine.sampling import SamplingParams
from engine.text.incremental import TextFeed


@dataclass(eq=False)  # compared by identity: a sequence is one request
class Sequence:
    request_id: int
    request: SynthesisRequest
    prompt: Prompt | None  # streaming text: built at admission, from the first ids
    sampling: SamplingParams
    max_frames: int
    feed: TextFeed | None = None  # streaming text
    room: int | None = None  # frames its KV slot holds after its prompt (known once the prompt is built)
    slot: int = -1
    frames: int = 0
    # frames not yet queued for decoding, each a row [16] of its step's codes (numpy: a step's hundreds of rows as
    # tensor views cost microseconds each to make, stack and free, on the path from one step's codes to the next)
    pending: list[np.ndarray] = field(default_factory=list)
    decoded_frames: int = 0
    done: str | None = None
    error: VoxgateError | None = None
    cancelled: bool = False
    paused: bool = False  # its listener takes no more audio for now (`Engine.pause`)
    paused_at: float | None = None
    first_audio_at: float | None = None  # when its first frame was made, later by the time it spent paused

    @property
    def interactive(self) -> bool:
        return self.request.interactive

    @property
    def owner(self) -> str | None:
        return self.request.owner

    def text_id(self) -> int | None:
        """The text token of the next frame; None holds the request (its text has not arrived)."""
        return self.feed.text_id(self.frames) if self.feed is not None else self.prompt.text_id(self.frames)

    def runnable(self) -> bool:
        """Its next frame can run: it is not paused and its text token is in."""
        return not self.paused and self.text_id() is not None

    def ready(self) -> bool:
        """Its prefill has its text: the first token, or for voice cloning enough tokens to fill the reference's
        frames (its text track is laid over them), or the end of the input. A paused request is not admitted: it
        would hold a slot and run nothing."""
        if self.paused:
            return False
        feed = self.feed
        if feed is None or self.prompt is not None or feed.ended:
            return True
        voice = self.request.voice
        if voice.ref_codes is None:
            return len(feed.ids) >= 1
        return len(voice.ref_text_ids) + len(feed.ids) >= voice.ref_codes.shape[0] + 1
