"""Run by test_llada2_tensor_parallel under `torchrun --nproc_per_node 2`: a LLaDA2 checkpoint loaded with
tp_plan="auto" decodes a batch; the main process writes the tokens and the local expert shapes as JSON."""

import json
import sys

import torch
from transformers import AutoModelForCausalLM

import hf_blockdiff  # noqa: F401  (registers the llada2_moe family)
from hf_blockdiff import BlockDiffusionConfig
from hf_blockdiff.integrations.distributed import load_sharded

CFG = BlockDiffusionConfig.from_preset("llada2_1", block_size=4, steps_per_block=4, max_new_tokens=12, eos_token_id=[],
                                       mask_token_id=95, pad_token_id=92, threshold=0.6, editing_threshold=0.6)
PROMPTS = torch.tensor([[5, 17, 33, 2, 61, 8, 40], [92, 92, 71, 9, 12, 50, 3]])
MASK = torch.tensor([[1] * 7, [0, 0] + [1] * 5])


def main(checkpoint: str, output: str) -> None:
    model = load_sharded(AutoModelForCausalLM, checkpoint, 2, "cpu", dtype=torch.float32)  # gloo, also on GPU hosts
    out = model.generate_multi_block(PROMPTS, CFG, attention_mask=MASK, return_dict=True)
    if torch.distributed.get_rank() == 0:
        experts = model.model.layers[1].mlp.experts
        report = {"tokens": out.sequences.tolist(), "edits": out.edits.tolist(), "tp_size": model.tp_size,
                  "gate_up_proj": list(experts.gate_up_proj.to_local().shape
                                       if hasattr(experts.gate_up_proj, "to_local") else experts.gate_up_proj.shape)}
        with open(output, "w") as f:
            json.dump(report, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
