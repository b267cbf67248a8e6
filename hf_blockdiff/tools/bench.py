"""`hf-blockdiff bench`: hf_blockdiff against a reference decoder, same process, same inputs.

The reference is chosen by the model. Block-causal models: how SDAR's generate.py decodes with stock transformers (a
DynamicCache, a staircase prefill, read-only denoise forwards whose block K/V are cropped away again, one store
forward per block, the whole vocabulary softmaxed in fp32 for every position of the block); both sides decode with
`low_confidence_static`-style schedules. Bidirectional models: LLaDA's generate.py (the whole canvas recomputed every
step). LLaDA2 models: diffusers' LLaDA2Pipeline (tools/diffusers_reference.py) against the `llada2` preset, or
`llada2_1` with `--editing-threshold`; the report adds the MoE layer against its dense-equivalent GEMMs
(tools/moe_timing.py). The report gives tok/s, ms per forward, forwards (NFE), tokens per forward (TPF, per prompt),
peak memory and the speedup, with the exact settings, and the wall time of the process's first call (torch.compile,
graph capture and warm-up included: the cold start). `--tensor-parallel` under `torchrun` shards the model with
transformers' tp_plan="auto" over the launch's processes on `--device` (tools/bench_models.py), `--expert-parallel`
its experts by expert; the first process reports.
"""

from __future__ import annotations

import json
import sys
import time

import torch

from ..cache.keyword import cache_kwarg
from ..config import BlockDiffusionConfig
from ..config.checks import decoded_block_size
from ..fusion.compile_worker import WORKER
from ..integrations import compile_cache
from ..integrations.checkpoint import check_device
from ..integrations.distributed import group_share, is_main_process, launch_size
from ..patching import free_cache
from ..config.profiles import model_profile
from ..weights.shard_layout import local_weight_bytes
from .bench_models import LLADA2, SHAPES, build_model
from .decode_flags import add_decode_flags, block_flags_given, decode_config
from .measure import across_groups, make_report, measure, recompile_limits_hit
from .diffusers_reference import llada2_pipeline
from .rollout_bench import kv_peak, rollout_runs, with_shared_prefix



def _commit_top(x, logits, masked, count, mask_id):
    """The reference's low_confidence_static: the `count` most confident masked positions take their argmax."""
    logits[..., mask_id] = float("-inf")
    confidence, proposal = torch.softmax(logits.float(), dim=-1).max(-1)
    confidence = confidence.masked_fill(~masked, -1.0)
    chosen = torch.zeros_like(masked).scatter_(1, confidence.topk(count, -1).indices, True) & masked
    return torch.where(chosen, proposal, x)


@torch.no_grad()
def llada_loop(model, prompts: torch.Tensor, cfg: BlockDiffusionConfig) -> int:
    """LLaDA generate.py with stock transformers: the whole canvas recomputed for every step of every block."""
    batch, length = prompts.shape
    size, steps, new = cfg.block_size, cfg.steps_per_block, cfg.max_new_tokens
    x = torch.full((batch, length + new), cfg.mask_token_id, dtype=torch.long, device=prompts.device)
    x[:, :length] = prompts
    forwards = 0
    for lo in range(length, length + new, size):
        hi = min(lo + size, length + new)
        schedule = [(hi - lo) // steps + (t < (hi - lo) % steps) for t in range(steps)]
        for count in schedule:
            logits = model(input_ids=x).logits[:, lo:hi]
            forwards += 1
            x[:, lo:hi] = _commit_top(x[:, lo:hi], logits, x[:, lo:hi] == cfg.mask_token_id, count, cfg.mask_token_id)
    return forwards


@torch.no_grad()
def reference_loop(model, prompts: torch.Tensor, cfg: BlockDiffusionConfig) -> int:
    """SDAR generate.py with stock transformers for a batch of equal-length prompts; returns the forward count."""
    from transformers import DynamicCache

    batch, length = prompts.shape
    size, steps, new = cfg.block_size, cfg.steps_per_block, cfg.max_new_tokens
    total = -(-(length + new) // size) * size
    x = torch.full((batch, total), cfg.mask_token_id, dtype=torch.long, device=prompts.device)
    x[:, :length] = prompts
    blocks = torch.arange(total, device=prompts.device) // size
    allowed = blocks[:, None] >= blocks[None, :]
    cache, forwards = DynamicCache(), 0

    def forward(lo, hi):
        mask = allowed[lo:hi, :hi][None, None].expand(batch, 1, -1, -1)
        position = torch.arange(lo, hi, device=x.device)[None].expand(batch, -1)
        return model(input_ids=x[:, lo:hi], attention_mask=mask, position_ids=position, **cache_kwarg(cache),
                     use_cache=True).logits

    prefill = length // size * size
    if prefill:
        forward(0, prefill)
        forwards += 1
    schedule = [size // steps + (t < size % steps) for t in range(steps)]
    for block in range(length // size, total // size):
        lo, hi = block * size, (block + 1) * size
        for step in range(steps + 1):
            masked = x[:, lo:hi] == cfg.mask_token_id
            logits = forward(lo, hi)
            forwards += 1
            if not bool(masked.any()):
                break  # that was the store forward: its K/V stay
            cache.crop(-size)  # read-only denoise: drop the block's K/V again
            x[:, lo:hi] = _commit_top(x[:, lo:hi], logits, masked, schedule[min(step, steps - 1)], cfg.mask_token_id)
    return forwards


def diffusers_llada2(model, prompts: torch.Tensor, cfg: BlockDiffusionConfig) -> int:
    """diffusers' LLaDA2Pipeline under the same settings; returns its forward count."""
    return llada2_pipeline(model, prompts, cfg)[1]


def _reference(model):
    """The reference decoder for the model, returning its forward count."""
    if model.config.model_type == LLADA2:
        return diffusers_llada2
    return llada_loop if model_profile(model).attention == "bidirectional" else reference_loop


def _new_shape_calls(model, cfg: BlockDiffusionConfig, args, vocab: int) -> tuple:
    """A call at another prompt length (3/4 of it, plus one) and batch size (half, or one more below 4), as an eval
    loop's next batch makes it, then the same call warm: (new shape call, warm call)."""
    batch = args.batch_size + 1 if args.batch_size < 4 else args.batch_size // 2
    generator = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, vocab, (batch, args.prompt_len * 3 // 4 + 1), generator=generator).to(model.device)

    def call():
        return model.generate_multi_block(prompts, cfg, return_dict=True).num_forwards

    return tuple(measure(f"hf_blockdiff (new shape{name})", call, args.device, batch * args.new_tokens, batch)
                 for name in (" call", ", warm"))


def _check_args(args) -> None:
    """The bench's flags that do not go together, refused before anything is built."""
    canvas = SHAPES[args.shape]["model_type"] == "diffusion_gemma"  # benched by tools/diffusion_gemma_bench.py
    if args.compile_cache and (canvas or args.num_return_sequences > 1 or args.shared_prefix):
        raise ValueError("--compile-cache times the block-decoding bench's first call: drop it with "
                         "--num-return-sequences, --shared-prefix and the diffusion-gemma shapes.")
    if (args.expert_parallel or args.tensor_parallel_size) and not args.tensor_parallel:
        raise ValueError("--expert-parallel and --tensor-parallel-size shard over the processes of --tensor-parallel: "
                         "add --tensor-parallel (under torchrun --nproc_per_node N)")
    if args.tensor_parallel and launch_size() < 2:
        raise ValueError("--tensor-parallel shards over the processes of a launch: run the bench under "
                         "`torchrun --nproc_per_node N -m hf_blockdiff.cli bench ...` (N dividing the head counts)")
    ignored = block_flags_given(args) if canvas else []
    if ignored:
        raise ValueError(f"the diffusion-gemma shapes decode by DiffusionGemma's own rules, which read no "
                         f"{', '.join(ignored)}: drop them (--denoising-steps sets its steps)")
    if args.tensor_parallel_size and canvas:
        raise ValueError("the diffusion-gemma shapes bench one tensor-parallel group: drop --tensor-parallel-size")
    if args.tensor_parallel_size and args.batch_size < launch_size() // args.tensor_parallel_size:
        raise ValueError(f"--batch-size {args.batch_size} leaves a data-parallel group of --tensor-parallel-size "
                         f"{args.tensor_parallel_size} without prompts: pass at least one prompt per group "
                         f"({launch_size() // args.tensor_parallel_size})")


def bench(args) -> dict:
    _check_args(args)
    tp_size = (args.tensor_parallel_size or launch_size()) if args.tensor_parallel else 0
    if SHAPES[args.shape]["model_type"] == "diffusion_gemma":
        from .diffusion_gemma_bench import bench as diffusion_gemma_bench

        return dict(diffusion_gemma_bench(args, tp_size), device=_device_name(args))
    device, dtype = args.device, getattr(torch, args.dtype)
    started = time.perf_counter()
    model = build_model(args.shape, args.model, device, dtype, args.quantization, tp_size, args.layers,
                        args.expert_parallel)
    build_s = round(time.perf_counter() - started, 1)  # random weights are initialized, checkpoints read, here
    vocab = model.config.get_text_config().vocab_size
    cfg, reference = decode_config(args, model), _reference(model)
    mask_id = cfg.mask_token_id
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, min(vocab, mask_id) - 1, (args.batch_size, args.prompt_len), generator=generator)
    if tp_size and tp_size < launch_size():  # data parallel over the groups: each decodes its share of the batch
        prompts = torch.stack(group_share(list(prompts), tp_size))
    prompts, tokens = prompts.to(model.device), len(prompts) * args.new_tokens  # --tensor-parallel: cuda:LOCAL_RANK
    if args.num_return_sequences > 1 or args.shared_prefix:
        return _rollout_report(args, model, cfg, prompts)
    results = []
    started = time.perf_counter()
    loaded = compile_cache.load(model, args.compile_cache) if args.compile_cache else None
    load_s = round(time.perf_counter() - started, 2)  # the artifacts the last process used are read here

    def ours():
        return model.generate_multi_block(prompts, cfg, return_dict=True).num_forwards

    landed = WORKER.landed
    first = across_groups(measure("hf_blockdiff (first call)", ours, device, tokens, len(prompts)))
    background = _background_compile(landed, ours, device, tokens, len(prompts)) if args.compile_cache else None
    results.append(across_groups(measure("hf_blockdiff", ours, device, tokens, len(prompts))))
    peak = torch.cuda.max_memory_allocated() if device.startswith("cuda") else None  # of the timed call
    new_shape = _new_shape_calls(model, cfg, args, min(vocab, mask_id) - 1)
    free_cache(model)  # the reference gets the memory of our KV cache and graphs
    if not args.skip_reference:
        results.append(measure(f"reference ({reference.__name__})", lambda: reference(model, prompts, cfg), device,
                                tokens, len(prompts)))
    report = make_report(args, _device_name(args), first, results)
    report["new_shape_call"] = new_shape[0].row()  # another prompt length and batch size, after the first shape
    report["new_shape_overhead_s"] = round(new_shape[0].seconds - new_shape[1].seconds, 3)  # less its warm time
    if args.compile_cache:
        report["compile_cache"] = {"loaded": loaded, "load_s": load_s,
                                   "saved": str(compile_cache.save(model, args.compile_cache)),
                                   "background_compile": background}
    report["build_s"] = build_s
    if args.tensor_parallel:
        report.update(_memory_per_gpu(model, peak))
    if model.config.model_type == LLADA2 and device.startswith("cuda") and not args.tensor_parallel:
        from .moe_timing import moe_against_dense

        block = decoded_block_size(cfg, model_profile(model))  # the preset's yields to the checkpoint's
        report["moe"] = [moe_against_dense(model, n * block) for n in sorted({1, args.batch_size})]
    return report


def _background_compile(landed: int, run, device: str, tokens: int, rows: int) -> dict:
    """After a first call that ran the step's bookkeeping and the layers' regions eager while the compile worker
    compiled them (`compile_cache.load`): the jobs the worker finished, the seconds waited for it after that call,
    and the next call, which captures the step's graphs again with the compiled code, so the warm call times the
    compiled step (run at every rank of a launch, jobs or not: its collectives need every rank)."""
    started = time.perf_counter()
    settled = compile_cache.settle()
    waited = time.perf_counter() - started
    again = across_groups(measure("hf_blockdiff (after the worker)", run, device, tokens, rows))
    return {"jobs": WORKER.landed - landed, "settled": settled, "waited_s": round(waited, 2),
            "next_call": again.row()}


def _memory_per_gpu(model, peak: int | None) -> dict:
    """Every process's weights (its shards and what it keeps whole) and peak allocated memory in the timed call
    (`peak` bytes; None on the CPU), in GB, in rank order."""
    mine = (round(local_weight_bytes(model) / 1e9, 3), None if peak is None else round(peak / 1e9, 3))
    every = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(every, mine)
    return {"weights_per_gpu_gb": [weights for weights, _ in every], "memory_per_gpu_gb": [peak for _, peak in every]}


def _device_name(args) -> str:
    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    kind = "tensor + expert parallel" if args.expert_parallel else "tensor parallel"
    groups = launch_size() // (args.tensor_parallel_size or launch_size())
    if groups > 1:
        kind = f"{kind} {args.tensor_parallel_size} x data parallel {groups}"
    return f"{name} x {launch_size()} ({kind})" if args.tensor_parallel else name


def _rollout_report(args, model, cfg: BlockDiffusionConfig, prompts: torch.Tensor) -> dict:
    """Shared rollouts against repeated prompts (tools/rollout_bench.py), each timed on its second call."""
    if not 0 <= args.shared_prefix <= args.prompt_len:
        raise ValueError(f"--shared-prefix {args.shared_prefix}: pass a length in [0, --prompt-len].")
    prompts = with_shared_prefix(prompts, args.shared_prefix)
    rows = args.batch_size * args.num_return_sequences
    results, memory, first_calls = [], [], []
    for name, run in rollout_runs(args, model, cfg, prompts):
        # the first call fills the prefix store, compiles and captures graphs
        first_calls.append(measure(f"{name} (first call)", run, args.device, rows * args.new_tokens, rows))
        results.append(measure(name, run, args.device, rows * args.new_tokens, rows))
        memory.append(kv_peak(model))
        free_cache(model)
    return {
        "settings": {key: value for key, value in vars(args).items() if key not in ("run", "json")},
        "device": _device_name(args),
        "first_call": first_calls[0].row(),  # the process's first call
        "results": [dict(m.row(), **kv) for m, kv in zip(results, memory)],
        "speedup": round(results[0].tok_s / results[1].tok_s, 2),
        "kv_ratio": round(memory[0]["kv_peak_pages"] / memory[1]["kv_peak_pages"], 3),
    }


def print_report(report: dict) -> None:
    print(f"device: {report['device']}   settings: {json.dumps(report['settings'])}")
    print(f"{'run':<30}{'seconds':>9}{'tok/s':>10}{'ms/forward':>12}{'NFE':>8}{'TPF':>8}{'peak GiB':>10}")
    rows = [report["first_call"], *report["results"], *([report["new_shape_call"]] if "new_shape_call" in report
                                                         else [])]
    for row in rows:
        print(f"{row['name']:<30}{row['seconds']:>9.2f}{row['tok_s']:>10.1f}{row['ms_per_forward']:>12.2f}"
              f"{row['forwards']:>8}{row['tokens_per_forward']:>8.2f}{row['peak_gib']:>10.2f}")
    if "kv_ratio" in report:
        print(f"speedup: {report['speedup']}x   peak KV GiB: {[row['kv_peak_gib'] for row in report['results']]}")
    elif "speedup" in report:
        print(f"speedup: {report['speedup']}x   first-call overhead (compile, graph capture, warm-up): "
              f"{report['first_call_overhead_s']} s")
    if "new_shape_overhead_s" in report:
        print(f"new-shape call overhead (another prompt length and batch size, less its warm time): "
              f"{report['new_shape_overhead_s']} s")
    for hit in report["recompile_limits_hit"]:
        print(f"warning: {hit} (it ran eager from then on: the times above are not the compiled path's)")


def run_bench(args) -> None:
    check_device(args.device, "--device")
    if args.kernels:
        from . import microbench

        microbench.print_table(microbench.run(device=args.device, flex=args.flex))
        return
    with recompile_limits_hit() as hits:
        report = bench(args)
    report["recompile_limits_hit"] = hits
    if not is_main_process():  # under --tensor-parallel every process decodes; the first one reports
        for hit in hits:
            print(f"warning: {hit}", file=sys.stderr)
        return
    print(json.dumps(report) if args.json else "", end="\n" if args.json else "")
    if not args.json:
        print_report(report)


def _add_model_flags(parser) -> None:
    """What is decoded: the shape or checkpoint, its size, weights and placement."""
    parser.add_argument("--shape", default="tiny", choices=sorted(SHAPES), help="architecture sizes with random "
                        f"weights: {', '.join(sorted(SHAPES))} (default: %(default)s)")
    parser.add_argument("--model", help="a checkpoint directory instead of a random-weight shape (default: --shape)")
    parser.add_argument("--layers", type=int, default=None, help="random weights: keep this many layers of the shape "
                        "(a time budget or a quick try of a large shape; default: all)")
    parser.add_argument("--denoising-steps", type=int, default=48, help="diffusion-gemma-26b-a4b: steps per "
                        "canvas on both sides (default: %(default)s, transformers' default)")
    parser.add_argument("--quantization", default="none", choices=["none", "int8", "fp8", "nf4"],
                        help="weight-only quantization: torchao int8 or fp8, bitsandbytes nf4 (with --model) "
                        "(default: %(default)s)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="default: cuda if there is a GPU, else cpu (here: %(default)s)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                        help="dtype of the weights: bfloat16, float16, float32 (default: %(default)s)")
    parser.add_argument("--tensor-parallel", action="store_true",
                        help="shard the model with transformers' tp_plan='auto' over the processes of a torchrun "
                        "launch, on --device: cuda (each process on its own GPU, NCCL) or cpu (gloo); the first "
                        "process reports (default: off)")
    parser.add_argument("--tensor-parallel-size", type=int, default=None, metavar="N",
                        help="with --tensor-parallel: shard over groups of N processes, the groups splitting the batch "
                        "(data parallel; default: the launch's size, one group)")
    parser.add_argument("--expert-parallel", action="store_true",
                        help="with --tensor-parallel, a MoE model's experts split whole over the processes "
                        "(num_experts / N each), attention still tensor parallel (default: off)")


def add_parser(commands) -> None:
    parser = commands.add_parser("bench", help="hf_blockdiff vs the plain-HF reference loop (tok/s, NFE, memory)")
    _add_model_flags(parser)
    parser.add_argument("--batch-size", type=int, default=1, help="prompts (default: %(default)s)")
    parser.add_argument("--prompt-len", type=int, default=256, help="tokens per prompt (default: %(default)s)")
    parser.add_argument("--new-tokens", type=int, default=256, help="tokens generated per prompt (default: %(default)s)")
    add_decode_flags(parser)
    parser.add_argument("--num-return-sequences", type=int, default=1,
                        help="samples per prompt: rollouts sharing their prompt's K/V against the same rows as "
                        "repeated prompts (no reference loop; default: %(default)s)")
    parser.add_argument("--shared-prefix", type=int, default=0,
                        help="tokens every prompt starts with (a system prompt), read from the prefix store after "
                        "the first call; with --num-return-sequences (default: %(default)s)")
    parser.add_argument("--skip-reference", action="store_true", help="time hf_blockdiff only (default: off)")
    parser.add_argument("--compile-cache", metavar="DIR", help="load torch.compile's artifacts of this model from DIR "
                        "before the first call and save them after (`hf-blockdiff warmup`; default: none); what DIR "
                        "lacks of the step's bookkeeping and the layers' regions runs eager while a worker process "
                        "compiles it, and the report's background_compile says when it was done")
    parser.add_argument("--kernels", action="store_true",
                        help="run the kernel microbenchmarks instead (default: off)")
    parser.add_argument("--flex", action="store_true",
                        help="with --kernels: add compiled FlexAttention (default: off)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON (default: off, a table)")
    parser.set_defaults(run=run_bench)
