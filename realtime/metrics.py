"""Prometheus metrics of one gateway (its own registry, so several gateways in one process, as in tests, do not mix).

TTFA, audio seconds and errors keep PROTOCOL.md's names and carry a `transport` label, `ws` for the socket and
`http` for `POST /v1/audio/speech`: `sum without (transport)` gives PROTOCOL.md's totals."""
from __future__ import annotations

import bisect
import gc
import itertools
import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.exposition import choose_encoder

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 5.0)
GC_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.2, 0.5)
GENERATIONS = 3  # CPython's
STEP_BUCKETS = (0.001, 0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.03, 0.05, 0.08, 0.12, 0.2, 0.5, 1.0)


class TransportMetrics:
    """The series one transport moves: its time to first audio, the audio it sent, the errors it sent by code."""

    def __init__(self, transport: str, ttfa: Histogram, audio_seconds: Counter, errors: Counter) -> None:
        self.transport = transport
        self.ttfa = ttfa.labels(transport=transport)
        self.audio_seconds = audio_seconds.labels(transport=transport)
        self._errors = errors

    def error(self, code: str) -> None:
        self._errors.labels(code=code, transport=self.transport).inc()


class CollectionPauses:
    """The process's garbage collections, timed (`gc.callbacks`): each stops every thread of the gateway, its event
    loop and so every stream included (engine/serving/heap.py). A collection can start inside any code, prometheus's
    own locked sections too, so the callback only adds to plain counters (no lock, nothing it could wait on, nothing
    that grows); a scrape reads them as a histogram (`collect`, a prometheus collector)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._buckets = [[0] * (len(GC_BUCKETS) + 1) for _ in range(GENERATIONS)]  # per generation, last: past all
        self._seconds = [0.0] * GENERATIONS
        self._started = 0.0
        registry.register(self)

    def watch(self) -> None:
        if self._on_collection not in gc.callbacks:
            gc.callbacks.append(self._on_collection)

    def unwatch(self) -> None:
        if self._on_collection in gc.callbacks:
            gc.callbacks.remove(self._on_collection)

    def collect(self) -> Iterator[HistogramMetricFamily]:
        family = HistogramMetricFamily("voxgate_gc_pause_seconds", "Garbage collections of the gateway process (each "
                                       "stops its event loop), by generation", labels=["generation"])
        for generation, counts in enumerate(self._buckets):
            cumulative = list(itertools.accumulate(counts))
            family.add_metric([str(generation)], [(str(bound), float(count)) for bound, count in
                                                  zip((*GC_BUCKETS, "+Inf"), cumulative)],
                              self._seconds[generation])
        yield family

    def _on_collection(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        seconds = time.perf_counter() - self._started
        generation = info["generation"]
        self._buckets[generation][bisect.bisect_left(GC_BUCKETS, seconds)] += 1
        self._seconds[generation] += seconds


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.sessions_active = Gauge("voxgate_sessions_active", "Open WebSocket sessions", registry=r)
        self.contexts_active = Gauge("voxgate_contexts_active", "Open contexts over all sessions", registry=r)
        self.engine_requests_active = Gauge("voxgate_engine_requests_active",
                                            "Engine requests running or waiting", registry=r)
        self.engine_queue_depth = Gauge("voxgate_engine_queue_depth", "Engine requests waiting for a slot",
                                        registry=r)
        ttfa = Histogram("voxgate_ttfa_seconds", "Time to first audio sent: per context (ws), per speech request "
                         "from its arrival (http)", ["transport"], buckets=LATENCY_BUCKETS, registry=r)
        audio_seconds = Counter("voxgate_audio_seconds", "Audio sent to clients", ["transport"], registry=r)
        errors = Counter("voxgate_errors", "Errors sent to clients, by code", ["code", "transport"], registry=r)
        self.socket = TransportMetrics("ws", ttfa, audio_seconds, errors)
        self.http = TransportMetrics("http", ttfa, audio_seconds, errors)
        self.step_seconds = Histogram("voxgate_engine_step_seconds", "Engine step wall time",
                                      buckets=STEP_BUCKETS, registry=r)
        self.step_batch = Histogram("voxgate_engine_step_batch", "Requests running in an engine step",
                                    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256), registry=r)
        self.collections = CollectionPauses(r)
        self.http_requests = Counter("voxgate_http_speech_requests", "POST /v1/audio/speech requests, by status",
                                     ["status"], registry=r)

    def on_step(self, seconds: float, batch: int) -> None:
        """Called from the engine thread after every step (prometheus_client is thread-safe)."""
        self.step_seconds.observe(seconds)
        self.step_batch.observe(batch)

    def render(self, accept: str = "") -> tuple[bytes, str]:
        """The exposition and its content type: OpenMetrics when `accept` (the request's Accept header) asks for
        it, Prometheus text 0.0.4 otherwise."""
        try:
            encode, content_type = choose_encoder(accept)
        except (TypeError, ValueError):  # prometheus_client fails on some malformed versions ("version=garbage")
            encode, content_type = choose_encoder("")
        return encode(self.registry), content_type
