"""`hf-blockdiff bench --shape diffusion-gemma-26b-a4b`: DiffusionGemma through generate_multi_block against
transformers' own `generate`, same process, same prompts, random weights (docs/fidelity.md, "DiffusionGemma").

Both sides run every canvas for exactly `--denoising-steps` steps (adaptive stopping is given a confidence no canvas
reaches), so they do the same work per step whatever the acceptance; the report gives tok/s, ms per denoising step
(`ms_per_forward`: a forward is a decoder step; encoder forwards are timed but not counted), denoising steps per
prompt (`forwards`), tokens per step (TPF, per prompt) and peak memory. `--layers` keeps the first N layers to fit a time budget.
"""

from __future__ import annotations

import accelerate
import torch

from .bench_models import prompt_ceiling
from .measure import make_report, measure

# DiffusionGemma 26B-A4B's text sizes as assumed here (no checkpoint is read: check them against the released
# config.json before quoting a number); 5:1 sliding/full layers come from the config's default pattern
SIZES_26B_A4B = dict(vocab_size=262_144, hidden_size=2816, intermediate_size=2112, num_hidden_layers=30,
                     num_attention_heads=16, num_key_value_heads=8, head_dim=256, global_head_dim=512,
                     num_global_key_value_heads=2, sliding_window=1024, num_experts=128, top_k_experts=8,
                     moe_intermediate_size=704, max_position_embeddings=262_144)
# a CPU-sized model of the same layout for tests: (text sizes, canvas length)
SHAPES = {"diffusion-gemma-26b-a4b": (SIZES_26B_A4B, 256),
          "diffusion-gemma-tiny": (dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=8, global_head_dim=16,
                                        num_global_key_value_heads=2, sliding_window=6, num_experts=4, top_k_experts=2,
                                        moe_intermediate_size=16, max_position_embeddings=256), 8)}
NEVER_CONFIDENT = 1e-30  # adaptive stopping on both sides, never firing: every canvas takes every step


def build(shape: str, layers: int | None, device: str, dtype: torch.dtype, tp_size: int = 0,
          expert_parallel: bool = False):
    """Random weights of `shape` on `device`, or with `tp_size` sharded over groups of that many processes
    (`build_sharded`: no process holds the whole model)."""
    from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion

    sizes, canvas = dict(SHAPES[shape][0]), SHAPES[shape][1]
    if layers is not None:
        sizes["num_hidden_layers"] = layers
        sizes["layer_types"] = ["full_attention" if (i + 1) % 6 == 0 or i == layers - 1 else "sliding_attention"
                                for i in range(layers)]
    config = DiffusionGemmaConfig(text_config=sizes, vision_config={"model_type": "gemma4_vision"},
                                  canvas_length=canvas)
    if tp_size:
        from ..integrations.distributed import build_sharded

        return build_sharded(config, tp_size, device, dtype, expert_parallel=expert_parallel,
                             model_class=DiffusionGemmaForBlockDiffusion).eval()
    # transformers builds the encoder's layers and the decoder's, then ties them: built on the GPU, the 30 layers
    # would first take twice their memory (96 GB in bfloat16). The parameters are declared without memory instead,
    # each tied group is allocated once (`materialize`); buffers are built as usual.
    with accelerate.init_empty_weights(include_buffers=False):
        model = DiffusionGemmaForBlockDiffusion._from_config(config, dtype=dtype)
    model.tie_weights()  # accelerate re-wraps each parameter set inside that context, undoing transformers' ties
    materialize(model, device, config.initializer_range)
    return model.to(device).eval()


def materialize(model, device: str, std: float) -> None:
    """Give every memoryless parameter of `model` random values on `device`, as transformers initializes this model:
    ones for vectors (norms) and scales, N(0, std) for matrices; parameters tied together stay one tensor."""
    made = {}  # id of a memoryless parameter -> (it, kept alive so its id stays unique; its replacement)
    for module in model.modules():
        for name, empty in list(module._parameters.items()):
            if empty is None or not empty.is_meta:
                continue
            if id(empty) not in made:
                value = torch.empty(empty.shape, dtype=empty.dtype, device=device)
                if empty.ndim == 1 or name.endswith("scale"):
                    value.fill_(1)
                else:
                    value.normal_(0, std)
                made[id(empty)] = empty, torch.nn.Parameter(value, requires_grad=False)
            module._parameters[name] = made[id(empty)][1]


def bench(args, tp_size: int = 0) -> dict:
    """The report of one process (`tp_size`: of a model sharded over that many; the caller reports for the launch)."""
    from ..config import BlockDiffusionConfig

    device, dtype = args.device, getattr(torch, args.dtype)
    model = build(args.shape, args.layers, device, dtype, tp_size, args.expert_parallel)
    device = str(model.device)
    steps, new = args.denoising_steps, args.new_tokens
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, prompt_ceiling(model), (args.batch_size, args.prompt_len), generator=generator)
    prompts = prompts.to(device)
    cfg = BlockDiffusionConfig(max_new_tokens=new, max_denoising_steps=steps, stop_confidence=NEVER_CONFIDENT,
                               attention_backend=args.attention_backend)

    def ours():
        out = model.generate_multi_block(prompts, cfg, return_dict=True)
        return int(out.steps.max())

    def reference():
        out = model.generate(prompts, max_new_tokens=new, max_denoising_steps=steps,
                             confidence_threshold=NEVER_CONFIDENT)
        return int(round(float((new / out.tokens_per_forward).max())))

    tokens = args.batch_size * new
    first = measure("hf_blockdiff (first call)", ours, device, tokens, args.batch_size)  # compiles, captures
    results = [measure("hf_blockdiff", ours, device, tokens, args.batch_size)]
    from ..patching import free_cache

    free_cache(model)
    if not args.skip_reference:
        results.append(measure("transformers generate", reference, device, tokens, args.batch_size))
    return make_report(args, "", first, results)
