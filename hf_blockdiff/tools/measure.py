"""Timing one decoder call the way `hf-blockdiff bench` reports it (tok/s, ms per forward, tokens per forward, peak
memory), shared by the block-decoding and the DiffusionGemma benches."""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass

import torch


@dataclass
class Measurement:
    name: str
    seconds: float
    forwards: int
    tokens: int
    rows: int
    peak_gib: float

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds

    def row(self) -> dict:
        return {**asdict(self), "tok_s": round(self.tok_s, 1), "ms_per_forward": round(1e3 * self.seconds / self.forwards, 2),
                "tokens_per_forward": round(self.tokens / self.forwards / self.rows, 3)}


def _synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def measure(name: str, run, device: str, tokens: int, rows: int) -> Measurement:
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    _synchronize(device)
    start = time.perf_counter()
    forwards = run()
    _synchronize(device)
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.startswith("cuda") else 0.0
    return Measurement(name, seconds, forwards, tokens, rows, round(peak, 2))


def across_groups(mine: Measurement) -> Measurement:
    """A call of every data-parallel group of tensor-parallel ranks at once (`bench --tensor-parallel-size` below the
    launch's size) as one: all their tokens and rows, in the slowest group's time (one group: `mine`)."""
    from ..integrations.distributed import gather_groups

    every = gather_groups(mine)
    slowest = max(every, key=lambda m: m.seconds)
    return Measurement(mine.name, slowest.seconds, slowest.forwards, sum(m.tokens for m in every),
                       sum(m.rows for m in every), max(m.peak_gib for m in every))


def make_report(args, device_name: str, first: Measurement, results: list[Measurement]) -> dict:
    """The report of ours (`results[0]`, after the process's `first` call) against the reference (`results[1]`)."""
    report = {
        "settings": {key: value for key, value in vars(args).items() if key not in ("run", "json")},
        "device": device_name,
        "first_call": first.row(),  # the process's first call: compile and graph capture included
        "first_call_overhead_s": round(first.seconds - results[0].seconds, 3),
        "results": [m.row() for m in results],
    }
    if len(results) == 2:
        report["speedup"] = round(results[0].tok_s / results[1].tok_s, 2)
    return report


@contextmanager
def recompile_limits_hit():
    """What dynamo says inside of each compiled function that hit its recompile limit and so runs eager from then on,
    a slowdown nothing else reports (docs/kernels.md, "Kernels and backends": forwards installed as new objects did
    that to DiffusionGemma's compiled layers): its warning's first two lines (limit, function), or, where logging
    hides the warning, the count of such events from dynamo's counters."""
    from torch._dynamo.utils import counters

    hits = []

    class Hits(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            message = record.getMessage()
            if "hit config." in message:
                hits.append(" ".join(message.splitlines()[:2]))

    def events() -> int:
        return sum(n for key, n in counters["unimplemented"].items() if key.startswith("Dynamo recompile limit"))

    logger, handler, before = logging.getLogger("torch._dynamo.convert_frame"), Hits(logging.WARNING), events()
    logger.addHandler(handler)
    try:
        yield hits
    finally:
        logger.removeHandler(handler)
        unlogged = events() - before - len(hits)
        hits.extend(["torch._dynamo hit its recompile limit (the warning naming the function was not logged)"]
                    * max(unlogged, 0))
