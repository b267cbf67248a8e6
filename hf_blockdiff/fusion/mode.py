"""How the decoder layers run while decoding: as they are, with fused Triton RMSNorms, or compiled.

`decoding_mode(model, fusion)` routes the model's attention through hf_blockdiff for the duration of a block and,
with `fusion="norms"`, runs its stock RMSNorms as one Triton kernel each, with `fusion="compile"` its decoder layers
through torch.compile (inductor fuses norms, rotary embedding and the gated MLP's activation; the cache write and the
attention stay eager between the compiled pieces: two regions a layer where its attention runs fused,
`fusion/regions.py`). With either fusion the stock Qwen attentions run q/k/v as one
op and their q/k norms and rotary embedding in the cache's write kernel, and with `skinny=True` (the executor's
choice when its denoising forwards hold few tokens) the stock gated MLPs run as skinny-GEMM ops too, and with
`fusion="norms"` the stock decoder layers with their residual adds fused (`fusion/layers.py`); with either fusion the
stock MoE experts run on the experts op (`fusion/experts.py`). Everything is restored after, also when the block
raises.
"""

from __future__ import annotations

import functools
import zlib
from contextlib import contextmanager

import torch

from ..attention import ATTENTION_NAME, AttentionBackend
from ..attention.backends import TritonBackend
from ..config import BlockDiffusionConfig
from ..kernels.rmsnorm import rms_norm
from ..kernels.skinny_gemm import MAX_ROWS
from ..weights.quantization import compiles_well
from ..weights.tensor_parallel import layer_stacks, per_layer_values, tensor_parallel_size
from .compiling import compile_settings
from .experts import fused_experts
from .layers import fused_forwards, rotary_in_cache_attention_forward
from .regions import in_regions, regions_forward

# transformers' RMSNorm classes whose forward is exactly kernels.rmsnorm.rms_norm_reference
STOCK_RMS_NORMS = ("LlamaRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "Qwen3MoeRMSNorm")


def few_tokens(cfg: BlockDiffusionConfig, rows: int) -> bool:
    """Whether every denoising forward (the active blocks and a stored one per row, doubled with guidance) fits the
    skinny-GEMM kernel."""
    return (2 if cfg.guided else 1) * rows * (cfg.max_active_blocks + 1) * cfg.block_size <= MAX_ROWS


def fully_fused(model) -> bool:
    """Whether every decoder layer has a fused forward, its attention and MLP with it (`fusion/layers.py`)."""
    fused = {id(module) for module, _ in fused_forwards(model, layers=True)}
    layers = decoder_layers(model)
    return bool(layers) and all(id(layer) in fused for layer in layers)


def fusion_for(cfg: BlockDiffusionConfig, backend: AttentionBackend, graphs: bool, device: torch.device,
               model, rows: int) -> str:
    """"compile" (config `compile`), else "norms" beside a backend that fuses them, else "none". `compile=None`
    compiles with CUDA graphs, unless the weights compile badly (bitsandbytes, torchao int8) or every decoder layer
    runs fused at few tokens beside fused norms on one GPU, where compiling the layers buys nothing and its first call
    costs (docs/benchmarks.md, "Cold start"; `compile=True` there also compiles the step's bookkeeping, which buys
    8–9 %). Tensor-parallel layers compile, at few tokens too (12–15 % faster at batch 1 over two and four GPUs:
    docs/benchmarks.md, "Tensor parallel"): their sums trace into the compiled layers (docs/kernels.md, "Kernels and
    backends")."""
    if backend.batch_invariant:  # compiled layers choose their GEMMs by the row count (fusion/invariant.py)
        return "norms"
    compile_ = cfg.runtime.compile
    if compile_ is None:
        fused = (backend.fuses_norms and fully_fused(model) and few_tokens(cfg, rows)
                 and tensor_parallel_size(model) == 1)
        compile_ = graphs and device.type == "cuda" and not fused and compiles_well(model)
    return "compile" if compile_ else "norms" if backend.fuses_norms else "none"


def _fused_rms_norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    return rms_norm(hidden_states, self.weight, self.variance_epsilon)


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's repeated layers (`layer_stacks`)."""
    return [layer for _, layers in layer_stacks(model) for layer in layers]


@functools.cache
def compiled_forward(layer_type: type, dynamic: bool | None):
    """One torch.compile'd forward per decoder-layer class (and shape policy), shared by every layer of every model of
    that class; the layer index is not specialized on (it turns dynamic at the first recompile)."""
    return torch.compile(layer_type.forward, dynamic=dynamic)


def shape_policy(model) -> bool | None:
    """torch.compile's `dynamic` for the model's layers. One layer kind: None, automatic-dynamic shapes (the first shape
    compiles static, the next marks the dimensions that changed, tokens and rows, dynamic, and the widths stay
    constants; tracing every dimension as a symbol made SDAR-4B's first call on an H100 take 47 s instead of 27,
    docs/benchmarks.md, "Cold start"). Several kinds (Gemma-style sliding and full layers of one class, with different head
    dims): True, every dimension dynamic, so the class compiles once instead of recompiling per kind and per width
    (a tiny DiffusionGemma traced 35 frames automatic-dynamic, 17 all-dynamic)."""
    kinds = set(getattr(model.config.get_text_config(), "layer_types", None) or ())
    return None if len(kinds) <= 1 else True


# the text config's fields that fix a decoder layer's widths: with the dtype and tensor-parallel size, they key the
# profile of dimensions that turned dynamic (`profile_job`)
LAYER_SHAPE = ("hidden_size", "intermediate_size", "moe_intermediate_size", "num_attention_heads",
               "num_key_value_heads", "head_dim", "num_experts", "num_experts_per_tok", "layer_types", "sliding_window")


def profile_job(model) -> str:
    """The job id under which dynamo keeps its profile of the compiled layers' dimensions that turned dynamic
    (`compile_settings`): one per layer shape, so a process that compiled layers of other widths (another model of the
    same layer class) never has this model's widths traced as symbols. A field that varies by layer (DiffusionGemma's
    KV heads) counts with its value in each layer."""
    text = model.config.get_text_config()
    shape = [type(text).__name__, str(next(model.parameters()).dtype), tensor_parallel_size(model)]
    for name in LAYER_SHAPE:
        values = per_layer_values(text, name)
        shape.append(values[0] if len(values) == 1 else tuple(values))
    return f"hf_blockdiff-{zlib.crc32(repr(shape).encode()):08x}"


@contextmanager
def decoding_mode(model: torch.nn.Module, fusion: str = "none", skinny: bool = False, invariant: bool = False):
    """The model's forwards in `fusion`'s mode for the block (module docstring); `invariant`: the fused forwards'
    GEMMs in their batch-invariant launches (`fusion/invariant.py`). The fused forwards go in only where Triton's
    kernels run (`TritonBackend.runs_on`): without them, compiled layers on the CPU (no TRITON_INTERPRET=1) are the
    stock layers compiled by inductor's C++ backend."""
    norms = [m for m in model.modules() if type(m).__name__ in STOCK_RMS_NORMS] if fusion == "norms" else []
    layers = decoder_layers(model) if fusion == "compile" else []
    kernels = fusion != "none" and TritonBackend.runs_on(next(model.parameters()).device)
    projections = (fused_forwards(model, mlps=skinny, layers=fusion == "norms", invariant=invariant)
                   + fused_experts(model)) if kernels else []
    config = model.config
    implementation = config._attn_implementation
    config._attn_implementation = ATTENTION_NAME
    # a forward set on the instance before (transformers' tensor-parallel one on a replicated q/k norm) comes back
    previous = [(module, vars(module).get("forward")) for module in norms + layers + [m for m, _ in projections]]
    for norm in norms:
        norm.forward = _fused_rms_norm_forward.__get__(norm)
    for module, forward in projections:
        module.forward = forward
    dynamic = shape_policy(model) if layers else None  # read only when compiling: this runs at every forward
    unsharded = not layers or tensor_parallel_size(model) == 1
    fused = {id(module): forward for module, forward in projections}
    for layer in layers:
        attention = fused.get(id(getattr(layer, "self_attn", None)))
        layer.forward = (regions_forward(layer, dynamic, attention.__func__ is rotary_in_cache_attention_forward,
                                         unsharded)
                         if in_regions(layer, attention is not None, invariant) else
                         compiled_forward(type(layer), dynamic).__get__(layer))
    try:
        with torch._dynamo.config.patch(allow_unspec_int_on_nn_module=True), \
                compile_settings(profile_job(model) if layers else None):
            yield
    finally:
        config._attn_implementation = implementation
        for module, forward in previous:
            if forward is None:
                vars(module).pop("forward", None)
            else:
                module.forward = forward
