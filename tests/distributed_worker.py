"""Run by test_distributed under `torchrun --nproc_per_node 2`: tensor-parallel generation of a tiny checkpoint (and
of one whose KV heads cannot be split); the main process writes what it saw as JSON."""

import json
import sys

from hf_blockdiff import BlockDiffusionConfig
from hf_blockdiff.integrations.checkpoint import load_pretrained
from hf_blockdiff.integrations.distributed import generate_distributed, process_state

CFG = BlockDiffusionConfig(max_new_tokens=8, threshold=0.6, eos_token_id=[])
PROMPTS = ["hello", "x = 1", "abc def", "Once upon a time", "0123456789"]


def main(checkpoint: str, uneven_checkpoint: str, output: str) -> None:
    model, tokenizer = load_pretrained(checkpoint, tensor_parallel=True)
    completions = generate_distributed(model, PROMPTS, CFG, tokenizer, batch_size=2)
    uneven, _ = load_pretrained(uneven_checkpoint, tensor_parallel=True)
    try:
        generate_distributed(uneven, PROMPTS[:1], CFG, tokenizer)
        error = None
    except ValueError as failure:
        error = str(failure)
    if process_state().is_main_process:
        report = {
            "completions": [c.text for c in completions],
            "tp_size": model.tp_size,
            "cache_kv_heads": model._blockdiff_engine.cache.keys[0].shape[2],
            "uneven_error": error,
        }
        with open(output, "w") as f:
            json.dump(report, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
