"""`hf-blockdiff demo`: the bundled tiny SDAR model solves held-out problems with several decoding strategies.

The model (`hf_blockdiff.assets.demo_model_path()`, trained by `hf-blockdiff train-tiny`) answers additions, digit
sorting and word reversal (`hf_blockdiff.tools.tasks`). Every row of the table decodes the same problems with
`generate_multi_block`; `--json` prints every prompt, expected answer and output so anyone can recompute the accuracy
or re-generate a row.
"""

from __future__ import annotations

import json

import torch

from ..config import BlockDiffusionConfig
from ..assets import demo_model_path
from ..strategies import strategy_names
from .tasks import FAMILIES, family, make_problems, solve
from .train_tiny import DEFAULT_STEPS, PRESETS as TRAIN_PRESETS, answer_room, train

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


def load_demo(path: str | None):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = path or str(demo_model_path())
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    except (OSError, ValueError, KeyError) as error:
        raise ValueError(f"--model {path!r} is not a readable demo checkpoint ({error})") from error
    return model, tokenizer


def run_demo(args) -> None:
    unknown = [name for name in args.strategy or [] if name not in strategy_names() and name not in STRATEGIES]
    if unknown:
        raise ValueError(f"unknown strategy {unknown[0]!r}: choose from {', '.join(STRATEGIES)} or "
                         f"{', '.join(strategy_names())}")
    if args.num_problems < 1:
        raise ValueError(f"--num-problems {args.num_problems}: pass a positive number of problems to solve")
    task = family(args.task)
    model, tokenizer = load_demo(args.model)
    if tokenizer.unk_token_id in tokenizer(task.alphabet, add_special_tokens=False)["input_ids"]:
        raise ValueError(f"--model {args.model or 'the bundled model'}: its tokenizer lacks characters of task "
                         f"{args.task!r}; pass a checkpoint trained on it (train-tiny --preset {args.task})")
    problems = make_problems(args.num_problems, args.seed, "held_out", task=args.task)
    room = answer_room(args.task, model.config.block_size)
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
    print(f"{len(problems)} held-out problems of task {args.task!r} (seed {args.seed}): {', '.join(task.kinds)}; "
          f"e.g. {problems[0][0]}{problems[0][1]}")
    print(f"{'strategy':<26}{'accuracy':>10}{'forwards':>10}{'tokens/forward':>16}{'tok/s':>10}")
    for row in results:
        print(f"{row['strategy']:<26}{row['accuracy']:>10.1%}{row['num_forwards']:>10}"
              f"{row['tokens_per_forward']:>16.2f}{row['tok_s']:>10.1f}")


def run_train_tiny(args) -> None:
    from dataclasses import asdict

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
                      f"strategy name ({', '.join(strategy_names())}) (default: every label of the table)")
    demo.add_argument("--model", help="another checkpoint of the task (default: the bundled one)")
    demo.add_argument("--task", default="demo", choices=list(FAMILIES),
                      help="task family of the problems: demo, or hard for a train-tiny --preset hard checkpoint "
                      "(default: %(default)s)")
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
