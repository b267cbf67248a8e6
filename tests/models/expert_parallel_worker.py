"""Run by test_expert_parallel under `torchrun --nproc_per_node 2` (CPU, gloo): each tiny MoE checkpoint of FAMILIES is
loaded with its experts split over the two processes (attention tensor parallel) and decodes DECODE's prompts; a dense
checkpoint asked for expert parallelism is refused. Every process writes what it saw as JSON (OUTPUT.RANK). Given
only a checkpoint, rank 1 fails instead (`fail_on_rank_1`)."""

import json
import os
import sys

import torch

from hf_blockdiff import BlockDiffusionConfig
from hf_blockdiff.fusion.experts import _stock
from hf_blockdiff.integrations.checkpoint import load_pretrained
from hf_blockdiff.integrations.distributed import load_sharded

PROMPTS = torch.tensor([[5, 17, 33, 2, 61, 8, 40], [70, 70, 71, 9, 12, 50, 3]])
MASK = torch.tensor([[1] * 7, [0, 0] + [1] * 5])
# SDAR-MoE, LLaDA2: block-causal decoding with a threshold the sharp tiny models pass; DiffusionGemma: its canvas
CONFIGS = {
    "sdar_moe": BlockDiffusionConfig(block_size=4, max_new_tokens=12, threshold=0.6, eos_token_id=[]),
    "llada2_moe": BlockDiffusionConfig.from_preset("llada2_1", block_size=4, steps_per_block=4, max_new_tokens=12,
                                                   eos_token_id=[], mask_token_id=95, pad_token_id=92, threshold=0.6,
                                                   editing_threshold=0.6),
    "diffusion_gemma": BlockDiffusionConfig(max_new_tokens=16, max_denoising_steps=4, t_max=0.8, t_min=0.4,
                                            stop_stability=1, stop_confidence=1e-30, entropy_bound=3.0),
}


def decode(model, family: str) -> list[list[int]]:
    torch.manual_seed(7)  # DiffusionGemma's canvas draws its noise seeds from torch's generator
    return model.generate_multi_block(PROMPTS, CONFIGS[family], attention_mask=MASK, return_dict=True).sequences.tolist()


def load(family: str, checkpoint: str, **sharding):
    if family == "diffusion_gemma":
        from transformers import DiffusionGemmaForBlockDiffusion

        return load_sharded(DiffusionGemmaForBlockDiffusion, checkpoint, dtype=torch.float32, **sharding).eval()
    return load_pretrained(checkpoint, "cpu", tensor_parallel_size=sharding["size"],
                           expert_parallel=sharding["expert_parallel"])[0]


def experts_modules(model) -> list:
    return [m for m in model.modules() if hasattr(m, "gate_up_proj") and hasattr(m, "num_experts")]


def main(checkpoints: str, dense: str, output: str) -> None:
    report = {}
    for family, checkpoint in json.loads(checkpoints).items():
        model = load(family, checkpoint, size=2, device="cpu", expert_parallel=True)
        experts = experts_modules(model)
        report[family] = {"tokens": decode(model, family), "tp_size": model.tp_size,
                          "local_experts": sorted({m.num_experts for m in experts}),
                          "fused": any(_stock(m) for m in experts)}
    try:
        load_pretrained(dense, "cpu", tensor_parallel_size=2, expert_parallel=True)
    except ValueError as error:
        report["dense_error"] = str(error)
    with open(f"{output}.{os.environ['RANK']}", "w") as f:
        json.dump(report, f)


def fail_on_rank_1(checkpoint: str) -> None:
    """Rank 1 fails before its first forward while rank 0 decodes, waiting for it in the first collective."""
    model, _ = load_pretrained(checkpoint, "cpu", tensor_parallel_size=2, expert_parallel=True)
    if os.environ["RANK"] == "1":
        raise RuntimeError("rank 1 failed on purpose")
    decode(model, "sdar_moe")


if __name__ == "__main__":
    (fail_on_rank_1 if len(sys.argv) == 2 else main)(*sys.argv[1:])
