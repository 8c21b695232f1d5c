"""A session's configuration: the socket's query-string defaults, then `session.start` merged over them field by
field, allowed only until the first text (PROTOCOL.md)."""
from __future__ import annotations

from typing import Any

from realtime.lexicon import Lexicon
from realtime.ws.protocol import LexiconSource, ProtocolError, SessionChecks, SessionConfig, configure, lexicon_of


class SessionSettings:
    def __init__(self, config: SessionConfig, checks: SessionChecks, lexicons: LexiconSource | None = None) -> None:
        self.config, self.checks, self.lexicons = config, checks, lexicons
        self.text_started = False  # session.start is refused from then on
        # the server's default voice as `session.started` named it: the session keeps it, so that a stored default
        # deleted later refuses the next context (`unknown_voice`) instead of moving it to another voice unsaid
        self.default_voice: str | None = None

    def start(self, message: dict[str, Any]) -> list[ProtocolError]:
        """Merge a session.start; returns the errors of refused fields (the others apply). Raises ProtocolError
        after the first text, changing nothing."""
        if self.text_started:
            raise ProtocolError("invalid_message", "session.start must come before the first text.append; "
                                                   "nothing was changed")
        self.config, errors = configure(self.config, message, self.checks, self.lexicons)
        return errors

    def context_fields(self, message: dict[str, Any]) -> tuple[str | None, str | None, str]:
        """A new context's voice, instructions and language: its first text.append's, else the session's. As in
        `session.start`, a blank voice or language is refused (ProtocolError naming the context) and "" instructions
        mean none."""
        for name in ("voice", "language"):
            if message.get(name) is not None and not message[name].strip():
                raise ProtocolError("invalid_message", f"{name} must be a non-empty string",
                                    context_id=message["context_id"])

        def given(name: str, session_value: Any) -> Any:
            return message[name] if message.get(name) is not None else session_value
        return (given("voice", self.config.voice or self.default_voice),
                given("instructions", self.config.instructions), given("language", self.config.language))

    def context_lexicon(self, message: dict[str, Any]) -> Lexicon | None:
        """A new context's lexicon: its first text.append's (a name or rules), else the session's; raises
        ProtocolError(`invalid_message`) naming the context."""
        if message.get("lexicon") is None:
            return self.config.lexicon
        return lexicon_of(message["lexicon"], self.lexicons, "invalid_message", message["context_id"])
