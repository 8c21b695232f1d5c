"""Prometheus metrics of one gateway (its own registry, so several gateways in one process, as in tests, do not mix)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 5.0)
STEP_BUCKETS = (0.001, 0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.03, 0.05, 0.08, 0.12, 0.2, 0.5, 1.0)


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
        self.ttfa = Histogram("voxgate_ttfa_seconds", "Time to first audio frame sent, per context",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.audio_seconds = Counter("voxgate_audio_seconds", "Audio sent to clients", registry=r)
        self.errors = Counter("voxgate_errors", "Errors sent to clients, by code", ["code"], registry=r)
        self.step_seconds = Histogram("voxgate_engine_step_seconds", "Engine step wall time",
                                      buckets=STEP_BUCKETS, registry=r)
        self.step_batch = Histogram("voxgate_engine_step_batch", "Requests running in an engine step",
                                    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256), registry=r)
        self.http_requests = Counter("voxgate_http_speech_requests", "POST /v1/audio/speech requests, by status",
                                     ["status"], registry=r)

    def on_step(self, seconds: float, batch: int) -> None:
        """Called from the engine thread after every step (prometheus_client is thread-safe)."""
        self.step_seconds.observe(seconds)
        self.step_batch.observe(batch)

    def render(self) -> bytes:
        return generate_latest(self.registry)
