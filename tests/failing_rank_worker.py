"""Run by test_rank_failure as two processes of a launch without torchrun (nothing tears the others down): a tiny
checkpoint sharded over both on the CPU (gloo), then generation, during which rank 1 fails at its FAIL_AT-th
all-reduce, the middle of a forward: MODE "raise" (an exception, uncaught: the process ends with it) or "exit" (the
process killed: no Python unwinding). Rank 0 reports on stderr how long after its call began it raised."""

import os
import sys
import time

import torch.distributed as dist

from hf_blockdiff.integrations.checkpoint import load_pretrained
from hf_blockdiff.integrations.completions import complete

from distributed_worker import CFG, PROMPTS

FAIL_AT = 5


def failing_all_reduce(mode: str):
    """torch.distributed.all_reduce that fails at its FAIL_AT-th call."""
    all_reduce, calls = dist.all_reduce, []

    def wrapped(*args, **kwargs):
        calls.append(1)
        if len(calls) == FAIL_AT:
            if mode == "exit":
                os._exit(3)
            raise RuntimeError("rank 1 fails in the middle of a forward")
        return all_reduce(*args, **kwargs)
    return wrapped


def main(checkpoint: str, mode: str) -> None:
    model, tokenizer = load_pretrained(checkpoint, "cpu", tensor_parallel_size=2)
    if dist.get_rank() == 1:
        dist.all_reduce = failing_all_reduce(mode)
    started = time.monotonic()
    try:
        complete(model, PROMPTS, CFG, tokenizer)
    finally:
        print(f"rank {dist.get_rank()} left its call after {time.monotonic() - started:.1f} s", file=sys.stderr)


if __name__ == "__main__":
    main(*sys.argv[1:])
