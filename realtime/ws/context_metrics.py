"""When a context started speaking and when its first audio left: its time to first audio (a metric, and the
`metrics` of `context.done`), measured from the moment its text started speaking (PROTOCOL.md "Timing")."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from realtime.metrics import Metrics
from realtime.ws.utterances import UtterancePlanner


@dataclass
class ContextStats:
    created_at: float = field(default_factory=time.monotonic)
    speaking_since: float | None = None  # when its text started speaking
    first_audio_sent_at: float | None = None
    audio_sent_ms: float = 0.0

    def note_speaking(self, planner: UtterancePlanner) -> None:
        """After text, a flush, a mark or the end: the moment the first utterance started, seen as it came."""
        utterances = planner.utterances
        if self.speaking_since is None and utterances and utterances[0].started:
            self.speaking_since = time.monotonic()

    def since(self, planner: UtterancePlanner) -> float:
        """When the text started speaking: a flush or end (seen as it came), else the planner's start (a clause
        boundary or the buffering delay, noted when the context's task polled it)."""
        if self.speaking_since is None:
            utterances = planner.utterances
            started = utterances[0].started_at if utterances else None
            self.speaking_since = started if started is not None else self.created_at
        return self.speaking_since

    def first_sent(self, planner: UtterancePlanner, metrics: Metrics) -> None:
        self.first_audio_sent_at = time.monotonic()
        metrics.socket.ttfa.observe(self.first_audio_sent_at - self.since(planner))

    def summary(self, planner: UtterancePlanner, audio_ms: float, text_chars: int) -> dict:
        """`context.done`'s metrics."""
        ttfa = (self.first_audio_sent_at - self.since(planner)) * 1000 if self.first_audio_sent_at else None
        wall = time.monotonic() - (self.since(planner) or self.created_at)
        return {"ttfa_ms": round(ttfa, 1) if ttfa is not None else None,
                "rtf": round(wall / (audio_ms / 1000), 3) if audio_ms else None,
                "text_chars": text_chars}
