"""`GET /metrics` in Prometheus' text format (docs/architecture.md, "Server"): requests by endpoint and status, prompt
and committed tokens, rows by how they finished, the finished rows' decoding steps (tokens per forward is their
tokens over their steps, the TPF of docs/architecture.md, "Vocabulary"), and, read from the engine at each scrape,
its forwards, queue depth and slot occupancy. Rows are counted from the engine's updates (`observe`, in the engine
thread), whether or not a client still reads them. Each server has its own registry, so several in one process
(tests) do not collide."""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest

PREFIX = "hf_blockdiff"


class Metrics:
    def __init__(self, engine):
        self.registry = CollectorRegistry()
        self.requests = Counter(f"{PREFIX}_requests", "HTTP requests answered", ["endpoint", "status"],
                                registry=self.registry)
        self.prompt_tokens = Counter(f"{PREFIX}_prompt_tokens", "prompt tokens of admitted requests",
                                     registry=self.registry)
        self.completion_tokens = Counter(f"{PREFIX}_completion_tokens", "committed output tokens",
                                         registry=self.registry)
        self.rows = Counter(f"{PREFIX}_rows", "rows finished, by finish reason", ["finish_reason"],
                            registry=self.registry)
        self.row_forwards = Counter(f"{PREFIX}_row_forwards", "decoding steps of finished rows",
                                    registry=self.registry)
        tokens_per_forward = Gauge(f"{PREFIX}_tokens_per_forward", "completion tokens per decoding step of a row "
                                   "(TPF), over the finished rows", registry=self.registry)
        tokens_per_forward.set_function(self._tokens_per_forward)
        engine_gauges = {
            "engine_forwards": ("forwards the engine has run", lambda: engine.forwards),
            "queue_depth": ("rows waiting for a slot", lambda: engine.queue_depth),
            "slots_running": ("slots holding a row", lambda: engine.running),
            "slots": ("slots of the engine (--max-batch-size)", lambda: engine.slots),
            "slot_occupancy": ("fraction of the slots holding a row", lambda: engine.running / max(engine.slots, 1)),
        }
        for name, (text, read) in engine_gauges.items():
            Gauge(f"{PREFIX}_{name}", text, registry=self.registry).set_function(read)

        self.totals = (0, 0)  # committed tokens and decoding steps of the finished rows

    def _tokens_per_forward(self) -> float:
        tokens, steps = self.totals
        return tokens / steps if steps else 0.0

    def observe(self, update, row_tokens: int) -> None:
        """One RowUpdate (in the engine thread); `row_tokens`: the row's committed tokens, these included."""
        self.completion_tokens.inc(len(update.tokens))
        if update.finish_reason is not None:
            self.rows.labels(update.finish_reason).inc()
            self.row_forwards.inc(update.forwards)
            self.totals = (self.totals[0] + row_tokens, self.totals[1] + update.forwards)

    def exposition(self) -> tuple[bytes, str]:
        """The text of a scrape and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
