"""The skinny GEMMs' tile configurations swept at SDAR-8B's projection widths on one CUDA GPU (docs/kernels.md,
"Kernels and backends"; issue 36): one GPU's weights and a TP2 and a TP4 rank's shards (q/k/v grouped and gate/up gated,
column-parallel; o and down row-parallel, as linear_residual), at 1, 4, 16, 32 and 64 rows in bf16. For each shape:
cuBLAS's time (the ops' references: `F.linear` per weight, SiLU and product, residual add), then the kernel's time,
TB/s and program count in every candidate configuration that fits the device's shared memory, the one the ops choose
marked `chosen` and the fastest `best`, all in the JSON file; the output is a line per shape (cuBLAS, chosen, best).

    python benchmarks/skinny_tiles.py --json skinny_tiles.json

Times are medians of CUDA-graph replays (`microbench.time_ms`); the calls of a graph cycle over copies of the
weights that together exceed twice the L2 cache, so every call reads its weights from memory as a decode step does.
TB/s counts the weights, x, the outputs and the residual once. o and down run the kernel past 16 rows too, where the
op itself calls cuBLAS (`ONE_WEIGHT_MAX_ROWS`).
"""

import argparse
import itertools
import json
import math
import time
from dataclasses import asdict, dataclass

import torch

from hf_blockdiff.kernels import skinny_gemm
from hf_blockdiff.kernels.compile_ahead import compiling_ahead
from hf_blockdiff.kernels.device_limits import fitting, shared_memory_limit
from hf_blockdiff.tools.microbench import time_ms

HIDDEN, Q_WIDTH, KV_WIDTH, INTERMEDIATE = 4096, 32 * 128, 8 * 128, 12288  # SDAR-8B
SHARDS = (1, 2, 4)
ROWS = (1, 4, 16, 32, 64)
BLOCK_NS, BLOCK_KS, STAGES = (16, 32, 64), (128, 256, 512), (3, 4)
REP_MS = 5  # per timing: about 5 ms of calls per replay, 10 replays


@dataclass(frozen=True)
class Shape:
    projection: str  # qkv, gate_up, o, down
    shards: int
    rows: int
    widths: tuple  # output columns of each weight
    width: int  # K, the input features

    @property
    def gated(self) -> bool:
        return self.projection == "gate_up"

    @property
    def residual(self) -> bool:
        return self.projection in ("o", "down")


def shapes() -> list:
    """Every projection of one decoder layer, for each shard count and row count."""
    found = []
    for shards in SHARDS:
        projections = {"qkv": ((Q_WIDTH // shards, KV_WIDTH // shards, KV_WIDTH // shards), HIDDEN),
                       "gate_up": ((INTERMEDIATE // shards,) * 2, HIDDEN),
                       "o": ((HIDDEN,), Q_WIDTH // shards),
                       "down": ((HIDDEN,), INTERMEDIATE // shards)}
        for (projection, (widths, width)), rows in itertools.product(projections.items(), ROWS):
            found.append(Shape(projection, shards, rows, widths, width))
    return found


class Problem:
    """A shape's tensors: x, the outputs, the residual, and enough copies of the weights to leave the L2 cache."""

    def __init__(self, shape: Shape, l2_bytes: int, device: torch.device):
        self.shape = shape
        options = dict(device=device, dtype=torch.bfloat16)
        weight_bytes = sum(shape.widths) * shape.width * 2
        copies = 1 + math.ceil(2 * l2_bytes / weight_bytes)
        self.copies = [[torch.randn(n, shape.width, **options) / shape.width**0.5 for n in shape.widths]
                       for _ in range(copies)]
        self.x = torch.randn(shape.rows, shape.width, **options)
        outputs = shape.widths[:1] if shape.gated else shape.widths
        self.outputs = [self.x.new_empty(shape.rows, n) for n in outputs]
        self.residual = torch.randn(shape.rows, shape.widths[0], **options) if shape.residual else None
        out_elements = sum(out.numel() for out in self.outputs) * (1 + shape.residual)  # the residual: as many
        self.bytes = weight_bytes + 2 * (self.x.numel() + out_elements)
        self.calls = itertools.count()

    def weights(self) -> list:
        """The next copy: each call of a captured graph reads other weights."""
        return self.copies[next(self.calls) % len(self.copies)]

    def kernel(self, config: dict):
        def call():
            weights = self.weights()
            skinny_gemm._launch(self.x, weights, [None] * len(weights), self.outputs, self.shape.gated, False,
                                residual=self.residual, configs=(config,))
        return call

    def cublas(self):
        if self.shape.gated:
            return lambda: skinny_gemm.gated_linear_reference(self.x, *self.weights())
        if self.shape.residual:
            return lambda: skinny_gemm.linear_residual_reference(self.x, self.weights()[0], None, self.residual)
        return lambda: skinny_gemm.grouped_linear_reference(self.x, self.weights(), [None] * 3)


def slots(shape: Shape) -> tuple:
    """The kernel's three width slots (zeros for unused ones), as `_launch` fills them."""
    return shape.widths + (0,) * (3 - len(shape.widths))


def candidates(problem: Problem) -> tuple:
    """(the ops' choice, every grid configuration that fits the device's shared memory, the choice among them)."""
    shape = problem.shape
    chosen = skinny_gemm.device_configs(problem.x, slots(shape), shape.gated)[0]
    block_m = max(16, 1 << (shape.rows - 1).bit_length())
    grid = [dict(BLOCK_N=n, BLOCK_K=k, num_stages=s) for n, k, s in itertools.product(BLOCK_NS, BLOCK_KS, STAGES)]
    fit = list(fitting(grid, lambda c: skinny_gemm._shared_bytes(c, block_m, shape.gated, 2),
                       shared_memory_limit(problem.x.device)))
    return chosen, fit + [chosen] * (chosen not in fit)


def timed_us(fn, device: torch.device) -> float:
    try:
        return time_ms(fn, device.type, graph=True, rep_ms=REP_MS) * 1e3
    except RuntimeError as error:  # a configuration that does not load on this device (`compile_ahead.launch`)
        print(f"  skipped: {str(error).splitlines()[0][:100]}")
        return math.nan


def measure(shape: Shape, l2_bytes: int, device: torch.device) -> list:
    """One row for cuBLAS, one per candidate configuration."""
    problem = Problem(shape, l2_bytes, device)
    chosen, configs = candidates(problem)
    try:
        with compiling_ahead(device):  # the new variants compile in parallel
            for config in configs:
                problem.kernel(config)()
    except RuntimeError:
        pass  # what does not load is skipped when timed
    base = dict(asdict(shape), widths="+".join(map(str, shape.widths)))
    cublas_us = timed_us(problem.cublas(), device)
    rows = [dict(base, config="cublas", programs=0, us=cublas_us, tbps=problem.bytes / cublas_us / 1e6,
                 chosen=False, best=False)]
    for config in configs:
        us = timed_us(problem.kernel(config), device)
        programs = skinny_gemm._programs(slots(shape), shape.gated, config["BLOCK_N"])
        rows.append(dict(base, config=_name(config), programs=programs, us=us, tbps=problem.bytes / us / 1e6,
                         chosen=config == chosen, best=False))
    kernel_rows = [row for row in rows[1:] if not math.isnan(row["us"])]
    if kernel_rows:
        min(kernel_rows, key=lambda row: row["us"])["best"] = True
    return rows


def _name(config: dict) -> str:
    return f"N{config['BLOCK_N']} K{config['BLOCK_K']} s{config['num_stages']}"


def print_summary(rows: list) -> None:
    """A line per shape (the whole sweep is in the JSON): cuBLAS, the chosen configuration and the best one, each
    as µs and TB/s, and chosen / best."""
    print("shape | cuBLAS us TB/s | chosen config, programs, us, TB/s | best config, programs, us, TB/s | chosen/best")
    keys = ("projection", "shards", "rows")
    for key, group in itertools.groupby(rows, key=lambda row: tuple(row[k] for k in keys)):
        group = list(group)
        cublas = group[0]
        chosen = next(row for row in group if row["chosen"])
        best = next((row for row in group if row["best"]), chosen)
        print(f"{key[0]:>7} tp{key[1]} m{key[2]:<3} | {cublas['us']:7.2f} {cublas['tbps']:5.2f} | "
              f"{chosen['config']:>13} {chosen['programs']:>4}p {chosen['us']:7.2f} {chosen['tbps']:5.2f} | "
              f"{best['config']:>13} {best['programs']:>4}p {best['us']:7.2f} {best['tbps']:5.2f} | "
              f"{chosen['us'] / best['us']:5.2f}x")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="also write every row to this file")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("skinny_tiles.py needs a CUDA device")
    torch.manual_seed(0)
    properties = torch.cuda.get_device_properties(0)
    start = time.perf_counter()
    rows = []
    for shape in shapes():
        rows += measure(shape, properties.L2_cache_size, torch.device("cuda"))
        torch.cuda.empty_cache()
    print_summary(rows)
    device = dict(name=properties.name, sms=properties.multi_processor_count, l2_bytes=properties.L2_cache_size,
                  shared_memory_limit=shared_memory_limit(torch.device("cuda")), torch=torch.__version__,
                  seconds=round(time.perf_counter() - start, 1))
    print(f"\n{device}")
    if args.json:
        with open(args.json, "w") as file:
            json.dump(dict(device=device, rows=rows), file, indent=1)


if __name__ == "__main__":
    main()
