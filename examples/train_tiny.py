"""Train the tiny block-diffusion demo model and write it to the package's assets.

    python examples/train_tiny.py [--out hf_blockdiff/assets/demo_model] [--seed 0] [--steps N] [--threads 2]
"""

import argparse
import json
from dataclasses import asdict
from pathlib import Path

import torch

from hf_blockdiff.tools import train_tiny

DEFAULT_OUT = Path(__file__).resolve().parent.parent / "hf_blockdiff" / "assets" / "demo_model"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(DEFAULT_OUT))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=train_tiny.DEFAULT_STEPS)
    parser.add_argument("--threads", type=int, default=2, help="torch threads; results are bit-exact per thread count")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    metrics = train_tiny.train(args.out, seed=args.seed, steps=args.steps, device=args.device)
    print(json.dumps({k: v for k, v in asdict(metrics).items() if k != "losses"}, indent=2))


if __name__ == "__main__":
    main()
