"""The voice library on disk: one SQLite file under the data directory holding each stored voice's record and its
precomputed tensors (speaker embedding, reference codes) as bytes with their dtype and shape, so that a stored voice
is never encoded again, survives a restart, and costs nothing at request time.

Every row is keyed by the fingerprint of the checkpoint it was made for (`engine.checkpoint.checkpoint_fingerprint`):
a server lists and uses only its own checkpoint's voices. Calls block (disk, fsync): callers on the event loop run
them in a thread; one connection, guarded by a lock, serves every thread."""
from __future__ import annotations

import json
import os
import sqlite3
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.errors import VoxgateError

DATABASE_NAME = "voices.sqlite3"
SCHEMA_VERSION = 1
SCHEMA = """
CREATE TABLE IF NOT EXISTS voices (
    model TEXT NOT NULL,        -- the checkpoint's fingerprint
    name TEXT NOT NULL,
    kind TEXT NOT NULL,         -- 'clone' or 'design'
    transcript TEXT,            -- clone: the reference's transcript (in-context cloning); NULL: x-vector only
    instruction TEXT,           -- design: the VoiceDesign instruction
    audio_seconds REAL,         -- clone: the reference's length
    created_at REAL NOT NULL,   -- seconds since the epoch
    PRIMARY KEY (model, name)
);
CREATE TABLE IF NOT EXISTS voice_tensors (
    model TEXT NOT NULL,
    name TEXT NOT NULL,
    role TEXT NOT NULL,         -- 'xvector' or 'ref_codes'
    dtype TEXT NOT NULL,        -- torch's name: float32, bfloat16, int64, ...
    shape TEXT NOT NULL,        -- a JSON list
    data BLOB NOT NULL,
    PRIMARY KEY (model, name, role),
    FOREIGN KEY (model, name) REFERENCES voices (model, name) ON DELETE CASCADE
);
"""
TENSOR_ROLES = ("xvector", "ref_codes")


class VoiceStoreError(VoxgateError):
    """The data directory or its database cannot be used; the message is one line naming the problem."""


class VoiceNameTaken(Exception):
    """A voice of that name is already stored for this checkpoint."""


@dataclass(frozen=True)
class StoredVoice:
    """A stored voice's record and its tensors (on the CPU, as they were computed)."""
    name: str
    kind: str  # "clone" or "design"
    created_at: float
    transcript: str | None = None
    instruction: str | None = None
    audio_seconds: float | None = None
    xvector: torch.Tensor | None = None
    ref_codes: torch.Tensor | None = None

    def describe(self) -> dict:
        """The voice as the HTTP API shows it (its tensors left out)."""
        record = {"id": self.name, "kind": self.kind, "created_at": round(self.created_at, 3)}
        if self.kind == "clone":
            record |= {"mode": "icl" if self.ref_codes is not None else "x_vector", "transcript": self.transcript,
                       "audio_seconds": self.audio_seconds}
        else:
            record["instruction"] = self.instruction
        return record


def default_data_dir() -> Path:
    """$XDG_DATA_HOME/voxgate, or ~/.local/share/voxgate where it is not set (the XDG base directory rule)."""
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "voxgate"


def check_data_dir(data_dir: Path) -> None:
    """The data directory exists, or can be made, and can be written: told before the model loads."""
    try:
        data_dir.mkdir(parents=True, exist_ok=True)
    except OSError as failure:
        raise VoiceStoreError(f"--data-dir {data_dir}: {failure.strerror or failure}") from None
    if not os.access(data_dir, os.W_OK | os.X_OK):
        raise VoiceStoreError(f"--data-dir {data_dir} is not writable")


class VoiceStore:
    """The voices of one checkpoint (`model`: its fingerprint) in a SQLite database; `path` None keeps them in
    memory only (nothing persists: tests, embedding the gateway)."""

    def __init__(self, path: Path | None, model: str) -> None:
        self.path, self.model = path, model
        self._lock = threading.Lock()
        try:
            if path is not None:
                path.parent.mkdir(parents=True, exist_ok=True)
            self._db = sqlite3.connect(":memory:" if path is None else str(path), timeout=10,
                                       check_same_thread=False, isolation_level=None)
            self._db.execute("PRAGMA foreign_keys = ON")
            self._migrate()
        except (OSError, sqlite3.Error) as failure:
            raise VoiceStoreError(f"cannot use the voice library {path}: {failure}") from None

    @classmethod
    def in_data_dir(cls, data_dir: Path | None, model: str) -> "VoiceStore":
        return cls(None if data_dir is None else data_dir / DATABASE_NAME, model)

    def _migrate(self) -> None:
        version = self._db.execute("PRAGMA user_version").fetchone()[0]
        if version > SCHEMA_VERSION:
            raise VoiceStoreError(f"the voice library {self.path} was written by a newer voxgate (schema {version})")
        self._db.executescript(SCHEMA)
        self._db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")

    def voices(self) -> list[StoredVoice]:
        """This checkpoint's voices, oldest first."""
        with self._lock:
            rows = self._db.execute("SELECT name, kind, created_at, transcript, instruction, audio_seconds "
                                    "FROM voices WHERE model = ? ORDER BY created_at, name", (self.model,)).fetchall()
            tensors = self._db.execute("SELECT name, role, dtype, shape, data FROM voice_tensors WHERE model = ?",
                                       (self.model,)).fetchall()
        parts: dict[str, dict[str, torch.Tensor]] = {}
        for name, role, dtype, shape, data in tensors:
            parts.setdefault(name, {})[role] = tensor_from_bytes(data, dtype, json.loads(shape))
        return [StoredVoice(name, kind, created_at, transcript, instruction, seconds, **parts.get(name, {}))
                for name, kind, created_at, transcript, instruction, seconds in rows]

    def count(self) -> int:
        with self._lock:
            return self._db.execute("SELECT count(*) FROM voices WHERE model = ?", (self.model,)).fetchone()[0]

    def other_models(self) -> int:
        """How many voices belong to other checkpoints (kept, not served)."""
        with self._lock:
            return self._db.execute("SELECT count(*) FROM voices WHERE model != ?", (self.model,)).fetchone()[0]

    def add(self, voice: StoredVoice) -> None:
        """Store a voice in one transaction; raises VoiceNameTaken."""
        with self._lock:
            try:
                self._db.execute("BEGIN IMMEDIATE")
                self._db.execute("INSERT INTO voices VALUES (?, ?, ?, ?, ?, ?, ?)", (
                    self.model, voice.name, voice.kind, voice.transcript, voice.instruction, voice.audio_seconds,
                    voice.created_at))
                for role in TENSOR_ROLES:
                    tensor = getattr(voice, role)
                    if tensor is not None:
                        self._db.execute("INSERT INTO voice_tensors VALUES (?, ?, ?, ?, ?, ?)", (
                            self.model, voice.name, role, dtype_name(tensor), json.dumps(list(tensor.shape)),
                            tensor_bytes(tensor)))
                self._db.execute("COMMIT")
            except sqlite3.IntegrityError:
                self._db.execute("ROLLBACK")
                raise VoiceNameTaken(voice.name) from None
            except BaseException:
                if self._db.in_transaction:
                    self._db.execute("ROLLBACK")
                raise

    def delete(self, name: str) -> bool:
        """Remove a voice and its tensors; False when there was none of that name."""
        with self._lock:
            deleted = self._db.execute("DELETE FROM voices WHERE model = ? AND name = ?", (self.model, name))
            return deleted.rowcount > 0

    def close(self) -> None:
        with self._lock:
            self._db.close()


def dtype_name(tensor: torch.Tensor) -> str:
    return str(tensor.dtype).removeprefix("torch.")


def tensor_bytes(tensor: torch.Tensor) -> bytes:
    """The raw bytes of a tensor (any dtype, bfloat16 included: numpy has none), in native byte order."""
    return tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()


def tensor_from_bytes(data: bytes, dtype: str, shape: list[int]) -> torch.Tensor:
    kind = getattr(torch, dtype, None)
    if not isinstance(kind, torch.dtype):
        raise VoiceStoreError(f"a stored tensor has an unknown dtype {dtype!r}")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(kind).reshape(shape).clone()
