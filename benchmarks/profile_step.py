"""Where a decode step's GPU time goes: `python3 benchmarks/profile_step.py --batch-size 128` (from the repository
root; `PYTHONPATH=$PWD` where the package is not installed) prints the top CUDA kernels of one warm
generate_multi_block call on SDAR-4B shapes (random weights); under `torchrun --nproc_per_node N ...
--tensor-parallel` the first process prints its share of a model sharded over N GPUs.

`--steps-only` profiles two warm calls, of `--new-tokens` and of twice as many, and prints the difference per forward
grouped by kind of kernel, then how long the GPU sat idle between kernels (`idle_gaps`): the decode steps alone, the
prefill (the same in both calls) taken out; with `--all-ranks` every process prints its own. Read with care
(docs/benchmarks.md, "Tensor parallel"): a kernel launched early (programmatic dependent launch: our attention, skinny
GEMMs, rotary write) is charged for its wait, and a rank's collectives for the other ranks' profiler work, so take the
rank that waits least; the profiler's own host work shows as gaps over 50 us."""

import argparse
import os
import re
import time
from collections import Counter

import torch
from torch.profiler import ProfilerActivity, profile

from hf_blockdiff import BlockDiffusionConfig
from hf_blockdiff.integrations.distributed import launch_size
from hf_blockdiff.tools.bench_models import build_model

KINDS = (  # (kind, pattern of kernel names), first match wins
    ("all-gather", r"AllGather|all_gather"),  # a gathered LM head's logits
    ("all-reduce", r"one_shot|two_shot|nccl|allreduce|AllReduce"),
    ("skinny GEMM (ours)", r"_skinny_kernel"),
    ("GEMM (cuBLAS)", r"gemm|nvjet|sm90_|sm80_|cutlass|xmma|splitKreduce"),
    ("attention", r"_paged_attention_kernel|_merge_splits_kernel"),
    ("rotary write", r"_rotary_write_kernel"),
    ("scoring", r"_score_kernel"),
    ("experts", r"_experts_kernel|_group_kernel|_gate_kernel|_combine_kernel"),
    ("norms (ours)", r"_rms_norm_kernel"),
    ("inductor", r"^triton_"),
    ("copies, fills", r"Memcpy|Memset|copy|fill|CatArray"),
)


def kind(name: str) -> str:
    return next((k for k, pattern in KINDS if re.search(pattern, name)), "other")


def kernel_times(prof) -> Counter:
    """Microseconds of GPU time per kernel name."""
    times = Counter()
    for event in prof.key_averages():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            times[event.key] += getattr(event, "device_time_total", None) or event.cuda_time_total
    return times


GAP_CLASSES = ((4.0, "under 4 us (between a graph's kernels)"), (50.0, "4-50 us"),
               (float("inf"), "over 50 us (the host)"))


def idle_gaps(prof) -> Counter:
    """Microseconds the GPU ran no kernel, between the call's first kernel and its last, by `GAP_CLASSES`, and
    "kernels" (their count) and "busy" (us some kernel ran: kernels launched early overlap, so less than their sum)."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA)
    gaps = Counter(kernels=len(spans))
    if not spans:
        return gaps
    start, end = spans[0]
    for s, e in spans[1:]:
        if s > end:
            gaps["busy"] += end - start
            gaps[next(name for bound, name in GAP_CLASSES if s - end < bound)] += s - end
            start = s
        end = max(end, e)
    gaps["busy"] += end - start
    return gaps


def profiled(model, prompts, cfg) -> tuple[Counter, float, int, Counter]:
    """(kernel times, wall seconds, forwards, `idle_gaps`) of one call."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        out = model.generate_multi_block(prompts, cfg, return_dict=True)
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    return kernel_times(prof), wall, out.num_forwards, idle_gaps(prof)


def steps_only(model, prompts, cfg, rank: int, show: bool) -> None:
    """Every rank runs the calls (a sharded model's collectives); the ones `show` names print."""
    longer = cfg.replace(max_new_tokens=2 * cfg.max_new_tokens)
    model.generate_multi_block(prompts, longer)  # warm at both lengths
    short, long = profiled(model, prompts, cfg), profiled(model, prompts, longer)
    if not show:
        return
    forwards = long[2] - short[2]
    per_kernel = Counter({name: (long[0][name] - short[0][name]) / forwards for name in long[0]})
    by_kind = Counter()
    for name, us in per_kernel.items():
        by_kind[kind(name)] += us
    wall = (long[1] - short[1]) / forwards * 1e3
    print(f"[rank {rank}] decode steps only: {forwards} forwards, {wall:.3f} ms wall per forward, "
          f"{sum(by_kind.values()) / 1e3:.3f} ms of kernels")
    for name, us in by_kind.most_common():
        print(f"[rank {rank}]   {name:22s} {us / 1e3:7.3f} ms")
    gaps = {name: (long[3][name] - short[3][name]) / forwards for name in long[3]}
    print(f"[rank {rank}] per forward: {gaps.pop('kernels'):.0f} kernels, busy {gaps.pop('busy') / 1e3:.3f} ms; idle:")
    for name, us in gaps.items():
        print(f"[rank {rank}]   {name:40s} {us / 1e3:7.3f} ms")
    for name, us in per_kernel.most_common(12):
        print(f"[rank {rank}]     {us:8.1f} us  {name[:90]}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--shape", default="sdar-4b")
    parser.add_argument("--tensor-parallel", action="store_true")
    parser.add_argument("--steps-only", action="store_true")
    parser.add_argument("--all-ranks", action="store_true")
    args = parser.parse_args()
    model = build_model(args.shape, None, "cuda", torch.bfloat16,
                        tensor_parallel=launch_size() if args.tensor_parallel else 0)
    cfg = BlockDiffusionConfig(mask_token_id=model.config.mask_token_id, block_size=4, max_new_tokens=args.new_tokens,
                               strategy="low_confidence_static", attention="block_causal", eos_token_id=[])
    torch.manual_seed(0)
    prompts = torch.randint(0, 150000, (args.batch_size, 256)).to(model.device)
    model.generate_multi_block(prompts, cfg)
    rank = int(os.environ.get("RANK", 0))
    if args.steps_only:
        steps_only(model, prompts, cfg, rank, rank == 0 or args.all_ranks)
        return
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        out = model.generate_multi_block(prompts, cfg, return_dict=True)
        torch.cuda.synchronize()
    if rank == 0:
        print(f"forwards: {out.num_forwards}")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=60))


if __name__ == "__main__":
    main()
