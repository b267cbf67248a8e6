"""A/B of two checkouts on one device in one run: `python benchmarks/ab.py OLD_TREE [--batches 1,128] [--rounds 2]
[bench flags]` runs `hf-blockdiff bench --skip-reference --json` (SDAR-4B shapes, prompt 256, 256 new tokens unless
the flags say otherwise) from OLD_TREE and from this checkout, alternating, `rounds` times per batch size, each in a
fresh process, and prints every run and a table of the medians. OLD_TREE is a copy of the other revision
(`git archive REV | tar -x -C OLD_TREE`)."""

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

BENCH = ["--shape", "sdar-4b", "--prompt-len", "256", "--new-tokens", "256", "--skip-reference", "--json"]


def run(tree: Path, batch: int, flags: list[str]) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree))
    command = [sys.executable, "-m", "hf_blockdiff.cli", "bench", *BENCH, "--batch-size", str(batch), *flags]
    done = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{tree}: {' '.join(command)} failed:\n{done.stderr[-3000:]}")
    report = json.loads(done.stdout.strip().splitlines()[-1])
    return {"tok_s": report["results"][0]["tok_s"], "first_call_s": report["first_call"]["seconds"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("old", type=Path)
    parser.add_argument("--batches", default="1,128")
    parser.add_argument("--rounds", type=int, default=2)
    args, flags = parser.parse_known_args()
    trees = {"old": args.old.resolve(), "new": Path.cwd()}
    rows = []
    for batch in map(int, args.batches.split(",")):
        runs = {"old": [], "new": []}
        for _ in range(args.rounds):
            for side, tree in trees.items():
                runs[side].append(run(tree, batch, flags))
                print(json.dumps({"side": side, "batch": batch, **runs[side][-1]}), flush=True)
        old, new = (statistics.median(r["tok_s"] for r in runs[side]) for side in ("old", "new"))
        rows.append(f"| {batch} | {old:,.1f} | {new:,.1f} | {100 * (new / old - 1):+.1f} % |")
    print("| batch | old tok/s (median) | new tok/s (median) | change |\n|---|---|---|---|\n" + "\n".join(rows))


if __name__ == "__main__":
    main()
