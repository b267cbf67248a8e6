"""`GET /metrics` in Prometheus' text format (docs/architecture.md, "Server"): requests by endpoint and status, prompt
and completion tokens, the rows' decoding steps (tokens per forward is completion tokens over them, the TPF of
docs/architecture.md, "Vocabulary"), and, read from the engine at each scrape, its forwards, queue depth and slot
occupancy. Each server has its own registry, so several in one process (tests) do not collide."""

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

        self.totals = [0, 0]  # completion tokens and decoding steps of the finished rows

    def _tokens_per_forward(self) -> float:
        tokens, steps = self.totals
        return tokens / steps if steps else 0.0

    def finished_row(self, tokens: int, forwards: int) -> None:
        self.completion_tokens.inc(tokens)
        self.row_forwards.inc(forwards)
        self.totals = [self.totals[0] + tokens, self.totals[1] + forwards]

    def exposition(self) -> tuple[bytes, str]:
        """The text of a scrape and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
