"""`hf-blockdiff demo`: a bundled tiny SDAR model solves held-out problems with several decoding strategies.

`--model demo` (the default, `hf_blockdiff.assets.demo_model_path()`) answers additions, digit sorting and word
reversal; `--model hard` answers the hard task family (`hf_blockdiff.tools.tasks`); both were trained by
`hf-blockdiff train-tiny`. Every row of the table decodes the same problems with `generate_multi_block`; `--sweep`
decodes every strategy at several settings, greedy and sampled (`hf_blockdiff.tools.sweep`), `--plot` draws it, and
`--json` prints every prompt, expected answer and output so anyone can recompute the accuracy or re-generate a row.
"""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import torch

from ..assets import BUNDLED_MODELS, model_path
from ..config import BlockDiffusionConfig
from ..integrations.checkpoint import check_device
from ..strategies import strategy_names
from . import sweep
from .tasks import FAMILIES, family, make_problems, solve
from .train_tiny import DEFAULT_STEPS, PRESETS as TRAIN_PRESETS, RECORD_FILE, answer_room, train

DEMO_SEED = 1234
# label -> BlockDiffusionConfig fields
STRATEGIES = {
    "sequential": dict(strategy="sequential"),
    "low_confidence_static": dict(strategy="low_confidence_static"),
    "low_confidence_dynamic": dict(strategy="low_confidence_dynamic", threshold=0.9),
    "entropy_threshold": dict(strategy="entropy_threshold", threshold=0.3),
    "multi_block (K=2)": dict(strategy="low_confidence_dynamic", threshold=0.9, max_active_blocks=2,
                              block_add_threshold=0.5, decoded_token_threshold=1.0),
}


def load_demo(name: str | None):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = model_path(name or "demo")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    except (OSError, ValueError, KeyError) as error:
        raise ValueError(f"--model {path!r} is not a readable demo checkpoint ({error})") from error
    return model, tokenizer


def task_of(args) -> str:
    """`--task`, else the family the checkpoint was trained on (its training record), else demo."""
    record = Path(model_path(args.model or "demo")) / RECORD_FILE
    return args.task or (json.loads(record.read_text())["task"] if record.exists() else "demo")


def run_demo(args) -> None:
    if args.from_json:
        return redraw(args)
    if args.num_problems < 1:
        raise ValueError(f"--num-problems {args.num_problems}: pass a positive number of problems to solve")
    if not args.sweep and (args.set or args.plot):
        raise ValueError("--set and --plot are options of --sweep (or --from-json): add --sweep")
    if not args.sweep:
        unknown = [name for name in args.strategy or [] if name not in strategy_names() and name not in STRATEGIES]
        if unknown:
            raise ValueError(f"unknown strategy {unknown[0]!r}: choose from {', '.join(STRATEGIES)} or "
                             f"{', '.join(strategy_names())}")
    task_name = task_of(args)
    task = family(task_name)
    model, tokenizer = load_demo(args.model)
    if tokenizer.unk_token_id in tokenizer(task.alphabet, add_special_tokens=False)["input_ids"]:
        raise ValueError(f"--model {args.model or 'demo'}: its tokenizer lacks characters of task "
                         f"{task_name!r}; pass a checkpoint trained on it (train-tiny --preset {task_name})")
    problems = make_problems(args.num_problems, args.seed, "held_out", task=task_name)
    room = answer_room(task_name, model.config.block_size)
    heading = (f"{len(problems)} held-out problems of task {task_name!r} (seed {args.seed}): {', '.join(task.kinds)}; "
               f"e.g. {problems[0][0]}{problems[0][1]}")
    if args.sweep:
        run_sweep(args, model, tokenizer, problems, room, heading)
    else:
        run_table(args, model, tokenizer, problems, room, heading)


def run_table(args, model, tokenizer, problems, room: int, heading: str) -> None:
    chosen = {name: STRATEGIES.get(name, dict(strategy=name)) for name in (args.strategy or STRATEGIES)}
    results, outputs = [], {}
    for label, fields in chosen.items():
        solved = solve(model, tokenizer, problems, BlockDiffusionConfig(max_new_tokens=room, **fields))
        results.append({"strategy": label, "accuracy": round(solved.accuracy, 4), "num_forwards": solved.num_forwards,
                        "tokens_per_forward": round(solved.tokens_per_forward, 3), "tok_s": round(solved.tok_s, 1)})
        outputs[label] = solved.outputs
    if args.json:
        print(json.dumps({
            "results": results,
            "problems": [{"prompt": p, "expected": a, "outputs": {label: texts[i] for label, texts in outputs.items()}}
                         for i, (p, a) in enumerate(problems)],
        }))
        return
    print(heading)
    print(f"{'strategy':<26}{'accuracy':>10}{'forwards':>10}{'tokens/forward':>16}{'tok/s':>10}")
    for row in results:
        print(f"{row['strategy']:<26}{row['accuracy']:>10.1%}{row['num_forwards']:>10}"
              f"{row['tokens_per_forward']:>16.2f}{row['tok_s']:>10.1f}")


def run_sweep(args, model, tokenizer, problems, room: int, heading: str) -> None:
    if args.samples < 1:
        raise ValueError(f"--samples {args.samples}: pass a positive number of samples per problem")
    chosen = sweep.settings(args.strategy, sweep.parse_overrides(args.set or []), model.config.block_size)
    if args.plot:
        from .plot import pyplot

        pyplot()  # fails now, not after the sweep, when matplotlib is missing
    log = functools.partial(print, file=sys.stderr if args.json else sys.stdout, flush=True)
    log(heading)
    rows = sweep.run_sweep(model, tokenizer, problems, chosen, room, args.samples, args.seed, log)
    show(args, rows, problems, args.samples, f"{heading.split(':')[0]}, model {args.model or 'demo'}")


def redraw(args) -> None:
    """`--from-json`: the table, plot and JSON of sweep reports saved by earlier `--sweep --json` runs."""
    reports = []
    for path in args.from_json:
        try:
            reports.append(json.loads(Path(path).read_text()))
        except (OSError, json.JSONDecodeError) as error:
            raise ValueError(f"--from-json {path}: not a readable sweep report ({error})") from None
    rows, problems, samples = sweep.merge_reports(reports)
    names = " + ".join(Path(path).name for path in args.from_json)
    show(args, rows, problems, samples, f"{len(problems)} held-out problems, sweep reports {names}")


def show(args, rows, problems, samples: int, title: str) -> None:
    if args.plot:
        from .plot import plot_sweep

        plot_sweep(rows, args.plot, title)
    if args.json:
        print(json.dumps(sweep.report(rows, problems, samples)))
    else:
        sweep.print_table(rows, samples)


def run_train_tiny(args) -> None:
    from dataclasses import asdict

    check_device(args.device, "--device")
    torch.set_num_threads(args.threads)
    max_seconds = None if args.max_minutes is None else 60 * args.max_minutes
    metrics = train(args.out, seed=args.seed, steps=args.steps, device=args.device, config=TRAIN_PRESETS[args.preset],
                    max_seconds=max_seconds)
    if metrics is not None:
        print(json.dumps({k: v for k, v in asdict(metrics).items() if k != "losses"}, indent=2))


def add_parsers(commands) -> None:
    demo = commands.add_parser("demo", help="the bundled tiny model solves held-out problems with several strategies")
    demo.add_argument("--seed", type=int, default=DEMO_SEED, help="which held-out problems (default: %(default)s)")
    demo.add_argument("--num-problems", type=int, default=200, help="how many problems (default: %(default)s)")
    demo.add_argument("--strategy", nargs="*", help=f"labels of the demo table ({', '.join(STRATEGIES)}) or any "
                      f"strategy name ({', '.join(strategy_names())}); with --sweep, the strategies to sweep "
                      "(default: every label of the table; every strategy of the sweep)")
    demo.add_argument("--model", help=f"a bundled model ({', '.join(BUNDLED_MODELS)}) or a checkpoint directory of "
                      "train-tiny (default: demo)")
    demo.add_argument("--task", choices=list(FAMILIES),
                      help="task family of the problems (default: the one the model was trained on, from its "
                      f"{RECORD_FILE}; demo without one)")
    demo.add_argument("--sweep", action="store_true", help="every strategy at 2-3 settings of its parameter, "
                      "single- and multi-block and editing, greedy and at temperature 1 (default: off, the table)")
    demo.add_argument("--samples", type=int, default=4,
                      help="with --sweep: seeded samples per problem at temperature 1, for pass@1 and pass@N "
                      "(default: %(default)s)")
    demo.add_argument("--set", nargs="*", metavar="STRATEGY=V1,V2",
                      help="with --sweep: other values of a strategy's parameter (default: the sweep's own)")
    demo.add_argument("--from-json", nargs="+", metavar="FILE",
                      help="print the table (or JSON, plot) of sweep reports written by --sweep --json, in parts "
                      "of one sweep (other --strategy lists) read as one, without decoding (default: decode)")
    demo.add_argument("--plot", metavar="PATH",
                      help='with --sweep: write accuracy against tokens per forward as PNG (pip install '
                      '"hf-blockdiff[plot]") (default: no plot)')
    demo.add_argument("--json", action="store_true",
                      help="print every prompt, expected answer and output as JSON (default: off, a table)")
    demo.set_defaults(run=run_demo)
    train = commands.add_parser("train-tiny", help="train the demo model from scratch (deterministic per seed)")
    train.add_argument("--out", required=True, help="directory the checkpoint is written to (required)")
    train.add_argument("--seed", type=int, default=0, help="seed of the weights and the data (default: %(default)s)")
    train.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="training steps (default: %(default)s)")
    train.add_argument("--threads", type=int, default=2,
                       help="torch threads; results are exact per thread count (default: %(default)s)")
    train.add_argument("--device", default="cpu", help="device to train on (default: %(default)s)")
    train.add_argument("--preset", default="demo", choices=list(TRAIN_PRESETS),
                       help="task family and model size: demo (the bundled CPU model) or hard (11.4 M parameters, the "
                       "hard task family, for a GPU) (default: %(default)s)")
    train.add_argument("--max-minutes", type=float, help="stop after this long, leaving the run's state in --out; the "
                       "same command resumes it (default: no limit)")
    train.set_defaults(run=run_train_tiny)
