"""`hf-blockdiff demo --sweep`: every strategy at two or three settings of its parameter, greedy and sampled.

Each setting decodes the held-out problems greedily (accuracy, tokens per forward, forwards) and, at temperature 1,
`samples` times per problem with one seeded generator (pass@1: the mean accuracy of the samples; pass@k: the share of
problems that at least one sample solves). The greedy points (accuracy against tokens per forward) that no other point
beats in both are the Pareto front. Rows and plot: docs/benchmarks.md, "The strategy table".
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ..config import BlockDiffusionConfig
from ..strategies import strategy_names
from .tasks import Solved, is_correct, solve

STEPS = "steps_per_block"  # the parameter of the fixed-count strategies: B / S tokens per step
# strategy -> (the BlockDiffusionConfig field the sweep varies, its values)
SETTINGS: dict[str, tuple[str, tuple[float, ...]]] = {
    "sequential": (STEPS, (4, 2)),
    "anti_sequential": (STEPS, (4, 2)),
    "random": (STEPS, (4, 2)),
    "low_confidence_static": (STEPS, (4, 2, 1)),
    "least_entropy": (STEPS, (4, 2)),
    "top2_margin": (STEPS, (4, 2)),
    "maskgit_plus": (STEPS, (4, 2)),
    "topk_margin": (STEPS, (4, 2)),
    "entropy": (STEPS, (4, 2)),
    "low_confidence_dynamic": ("threshold", (0.9, 0.5)),
    "confidence_threshold": ("threshold", (0.9, 0.5)),
    "confidence_factor": ("factor", (0.5, 2.0)),
    "entropy_threshold": ("threshold", (0.1, 1.5)),
    "entropy_bounded": ("entropy_budget", (0.1, 1.5)),
    "dynamic_pmax": ("threshold", (0.9, 0.5)),
    "causal_waterfall": ("threshold", (0.9, 0.5)),
    "relative_top": ("relative_alpha", (0.9, 0.5)),
    "consensus_commit": ("threshold", (0.9, 0.5)),
    "logit_salience": ("threshold", (7.0, 5.0)),  # a z-score: at most √(V − 1) ≈ 7.4 for the 56-token vocabulary
}
# mode -> fields; the modes beyond single-block decode the confidence threshold rule at its settings
MODES = {
    "single-block": {},
    "multi-block K=2": dict(max_active_blocks=2, block_add_threshold=0.5, decoded_token_threshold=1.0),
    "editing": dict(editing_threshold=0.9),
}
MODE_STRATEGY = "low_confidence_dynamic"


@dataclass(frozen=True)
class Setting:
    mode: str
    strategy: str
    parameter: str
    value: float
    fields: dict = field(hash=False, compare=False)  # the BlockDiffusionConfig fields besides max_new_tokens

    @property
    def label(self) -> str:
        value = int(self.value) if self.parameter == STEPS else self.value
        mode = "" if self.mode == "single-block" else f" [{self.mode}]"
        return f"{self.strategy} {self.parameter}={value}{mode}"


def parse_overrides(texts: list[str]) -> dict[str, tuple[float, ...]]:
    """`--set STRATEGY=V1,V2` values -> {strategy: values}."""
    overrides = {}
    for text in texts:
        name, _, values = text.partition("=")
        if name not in SETTINGS:
            raise ValueError(f"--set {text!r}: unknown strategy {name!r}: choose from {', '.join(SETTINGS)}")
        try:
            overrides[name] = tuple(float(v) for v in values.split(","))
        except ValueError:
            raise ValueError(f"--set {text!r}: give {SETTINGS[name][0]} values as numbers, e.g. "
                             f"{name}={','.join(str(v) for v in SETTINGS[name][1])}") from None
    return overrides


def settings(strategies: list[str] | None, overrides: dict[str, tuple[float, ...]], block_size: int) -> list[Setting]:
    """The sweep's settings (of `strategies` only, when given), each checked as a config before anything decodes."""
    unknown = [name for name in strategies or [] if name not in SETTINGS]
    if unknown:
        raise ValueError(f"unknown strategy {unknown[0]!r} for --sweep: choose from {', '.join(SETTINGS)} "
                         f"(registered strategies: {', '.join(strategy_names())})")
    chosen = []
    for name in strategies or SETTINGS:
        parameter, values = SETTINGS[name][0], overrides.get(name, SETTINGS[name][1])
        modes = MODES if name == MODE_STRATEGY else {"single-block": {}}
        chosen += [_setting(mode, extra, name, parameter, value, block_size)
                   for mode, extra in modes.items() for value in values]
    return chosen


def _setting(mode: str, extra: dict, strategy: str, parameter: str, value: float, block_size: int) -> Setting:
    if parameter == STEPS and (value != int(value) or not 1 <= value <= block_size):
        raise ValueError(f"--set {strategy}={value:g}: {STEPS} must be a whole number from 1 to the model's block "
                         f"size {block_size} (tokens per step = {block_size} / {STEPS})")
    fields = dict(strategy=strategy, **{parameter: int(value) if parameter == STEPS else value}, **extra)
    try:
        BlockDiffusionConfig(**fields)
    except ValueError as error:
        raise ValueError(f"--set {strategy}={value:g} is outside the strategy's range: {error}") from None
    return Setting(mode, strategy, parameter, value, fields)


@dataclass
class SweepRow:
    setting: Setting
    greedy: Solved
    sampled: Solved
    pass_at_1: float
    pass_at_k: float
    on_front: bool = False


# The sweep makes two short calls per setting: on CUDA, capturing graphs and compiling layers anew for each would
# cost more than they save, and the tokens are the same without them (docs/architecture.md, "The decode loop").
EAGER = dict(cuda_graphs=False, compile=False)


def run_sweep(model, tokenizer, problems, chosen: list[Setting], new_tokens: int, samples: int, seed: int,
              log=None) -> list[SweepRow]:
    rows = []
    for setting in chosen:
        start = time.perf_counter()
        greedy_cfg = BlockDiffusionConfig(max_new_tokens=new_tokens, **setting.fields, **EAGER)
        greedy = solve(model, tokenizer, problems, greedy_cfg)
        sampled_cfg = BlockDiffusionConfig(max_new_tokens=new_tokens, temperature=1.0, **setting.fields, **EAGER)
        sampled = solve(model, tokenizer, problems, sampled_cfg, samples, torch.Generator().manual_seed(seed))
        solved = [[is_correct(prompt, sampled.outputs[i * samples + j]) for j in range(samples)]
                  for i, (prompt, _) in enumerate(problems)]
        rows.append(SweepRow(setting, greedy, sampled, pass_at_1=sum(map(sum, solved)) / (len(problems) * samples),
                             pass_at_k=sum(map(any, solved)) / len(problems)))
        if log:
            log(f"{setting.label}: greedy {greedy.accuracy:.3f} at {greedy.tokens_per_forward:.2f} tokens/forward, "
                f"pass@1 {rows[-1].pass_at_1:.3f} ({time.perf_counter() - start:.1f} s)")
    mark_front(rows)
    return rows


def mark_front(rows: list[SweepRow]) -> None:
    """Greedy points that no other point matches or beats in accuracy and tokens per forward, better in one."""
    points = [(row.greedy.accuracy, row.greedy.tokens_per_forward) for row in rows]
    for row, (acc, tpf) in zip(rows, points):
        row.on_front = not any(a >= acc and t >= tpf and (a, t) != (acc, tpf) for a, t in points)


def report(rows: list[SweepRow], problems, samples: int) -> dict:
    """The sweep as JSON: one result per setting, and every prompt, expected answer and output."""
    results = [{
        "label": row.setting.label, "mode": row.setting.mode, "strategy": row.setting.strategy,
        "parameter": row.setting.parameter, "value": row.setting.value, "accuracy": round(row.greedy.accuracy, 4),
        "tokens_per_forward": round(row.greedy.tokens_per_forward, 3), "num_forwards": row.greedy.num_forwards,
        "pass@1": round(row.pass_at_1, 4), f"pass@{samples}": round(row.pass_at_k, 4),
        "sampled_tokens_per_forward": round(row.sampled.tokens_per_forward, 3), "pareto": row.on_front,
    } for row in rows]
    return {"results": results, "samples": samples, "problems": [{
        "prompt": prompt, "expected": answer,
        "outputs": {row.setting.label: row.greedy.outputs[i] for row in rows},
        "samples": {row.setting.label: row.sampled.outputs[i * samples:(i + 1) * samples] for row in rows},
    } for i, (prompt, answer) in enumerate(problems)]}


def merge_reports(reports: list[dict]) -> tuple[list[SweepRow], list[tuple[str, str]], int]:
    """Rows, problems and samples of sweep reports (`--json`) over the same problems, the Pareto front re-marked
    over all their rows: a sweep run in parts reads as one."""
    first = reports[0]
    problems = [(p["prompt"], p["expected"]) for p in first["problems"]]
    if any([(p["prompt"], p["expected"]) for p in r["problems"]] != problems or r["samples"] != first["samples"]
           for r in reports):
        raise ValueError("--from-json: the reports decode other problems or sample counts; pass reports of one "
                         "--model, --seed, --num-problems and --samples")
    rows = []
    for report in reports:
        for result in report["results"]:
            label = result["label"]
            greedy = Solved(result["accuracy"], result["num_forwards"], result["tokens_per_forward"], 0.0,
                            [p["outputs"][label] for p in report["problems"]])
            sampled = Solved(result["pass@1"], 0, result["sampled_tokens_per_forward"], 0.0,
                             [text for p in report["problems"] for text in p["samples"][label]])
            setting = Setting(result["mode"], result["strategy"], result["parameter"], result["value"], {})
            rows.append(SweepRow(setting, greedy, sampled, result["pass@1"], result[f"pass@{first['samples']}"]))
    mark_front(rows)
    return rows, problems, first["samples"]


def print_table(rows: list[SweepRow], samples: int) -> None:
    print(f"{'setting':<56}{'accuracy':>9}{'tok/fwd':>9}{'forwards':>9}{'pass@1':>8}{f'pass@{samples}':>8}"
          f"{'T=1 tok/fwd':>12}  front")
    for row in rows:
        print(f"{row.setting.label:<56}{row.greedy.accuracy:>9.1%}{row.greedy.tokens_per_forward:>9.2f}"
              f"{row.greedy.num_forwards:>9}{row.pass_at_1:>8.1%}{row.pass_at_k:>8.1%}"
              f"{row.sampled.tokens_per_forward:>12.2f}  {'*' if row.on_front else ''}")
