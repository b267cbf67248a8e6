"""Where a decode step's GPU time goes: `python3 benchmarks/profile_step.py --batch-size 128` (from the repository
root; `PYTHONPATH=$PWD` where the package is not installed) prints the top CUDA kernels of one warm
generate_multi_block call on SDAR-4B shapes (random weights); under `torchrun --nproc_per_node N ...
--tensor-parallel` the first process prints its share of a model sharded over N GPUs."""

import argparse
import os

import torch
from torch.profiler import ProfilerActivity, profile

from hf_blockdiff import BlockDiffusionConfig
from hf_blockdiff.integrations.distributed import launch_size
from hf_blockdiff.tools.bench_models import build_model

parser = argparse.ArgumentParser()
parser.add_argument("--batch-size", type=int, default=1)
parser.add_argument("--new-tokens", type=int, default=64)
parser.add_argument("--shape", default="sdar-4b")
parser.add_argument("--tensor-parallel", action="store_true")
args = parser.parse_args()
model = build_model(args.shape, None, "cuda", torch.bfloat16,
                    tensor_parallel=launch_size() if args.tensor_parallel else 0)
cfg = BlockDiffusionConfig(mask_token_id=model.config.mask_token_id, block_size=4, max_new_tokens=args.new_tokens,
                           strategy="low_confidence_static", attention="block_causal", eos_token_id=[])
torch.manual_seed(0)
prompts = torch.randint(0, 150000, (args.batch_size, 256)).to(model.device)
model.generate_multi_block(prompts, cfg)
torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    out = model.generate_multi_block(prompts, cfg, return_dict=True)
    torch.cuda.synchronize()
if int(os.environ.get("RANK", 0)) == 0:
    print(f"forwards: {out.num_forwards}")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=60))
