"""`RuntimeOptions`: how a call runs on its device, apart from what it decodes, nested in
`BlockDiffusionConfig.runtime` as transformers nests `CompileConfig` in `GenerationConfig` (docs/architecture.md,
"Calling conventions"). Each option is also a keyword of `generate_multi_block`, `generate`, `BlockDiffusionConfig`,
`from_preset` and `replace`, which sets that field of `runtime`: one place of truth."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from .checks import fail, is_int

ATTENTION_BACKENDS = ("auto", "sdpa", "triton", "flash_attn")


@dataclass(frozen=True)
class RuntimeOptions:
    """attention_backend: "auto" (Triton on CUDA, sdpa on CPU), "sdpa", "triton" or "flash_attn" (FA2/FA3/FA4 if
    installed; docs/kernels.md). The backends decode the same tokens in float32; FlexAttention was measured and not
    kept (docs/benchmarks.md, "Kernel microbenchmarks").
    cuda_graphs: replay each decode step as a CUDA graph (None: on CUDA with the triton and flash_attn backends; True
    off CUDA runs the same fixed-shape step eagerly).
    compile: run the decoder layers through torch.compile while decoding (inductor fuses norms, rotary embedding and
    the MLP activation; shapes are dynamic, so it compiles once per layer class), and on CUDA with graphs the step's
    scheduler calls too (docs/kernels.md, "Kernels and backends"). None: with CUDA graphs (also for a
    tensor-parallel model), unless its quantized weights compile badly or every decoder layer already runs fused at
    ≤ 64 tokens per forward (stock Qwen2/Qwen3 layers beside the Triton backend). The first call pays the
    compilation (tens of seconds for a 4B model).
    page_size: tokens per KV-cache page (a power of two).
    max_cache_tokens: KV-cache capacity in tokens (default: 80 % of the free GPU memory on CUDA, unbounded on CPU);
    it limits how many prompts decode at once.
    prefix_cache_tokens: opt-in reuse of prompt prefixes across calls: up to this many tokens of earlier prompts'
    prefixes stay in the KV cache (units of lcm(page_size, block_size) tokens, least recently used evicted, emptied
    when the weights change) and a prompt starting with the same tokens reads them instead of computing them.
    Block-causal decoding with absolute blocks; 0: off (docs/architecture.md, "The cache").
    max_batch_size: prompts decoding at once, finished ones replaced by waiting ones (None: all of them, as the
    cache allows).
    batch_invariant: a row's bits independent of the rows decoded beside it, so a served request equals its offline
    call in bf16 too (docs/architecture.md, "Batch-invariant decoding"). On CUDA every projection and the LM head run
    on the skinny-GEMM kernel with one tile configuration per weight shape, attention in one key split, the layers
    uncompiled: dense Qwen-style decoder layers with plain weights (SDAR, Fast-dLLM v2) on the triton backend; other
    models are refused before any forward. On the CPU decoding is batch-invariant as it is (the option still checks
    its input); under TRITON_INTERPRET=1 with attention_backend="triton" it runs the kernels it runs on CUDA.
    """

    attention_backend: str = "auto"
    cuda_graphs: bool | None = None
    compile: bool | None = None
    page_size: int = 64
    max_cache_tokens: int | None = None
    prefix_cache_tokens: int = 0
    max_batch_size: int | None = None
    batch_invariant: bool = False

    def __post_init__(self) -> None:
        if self.attention_backend not in ATTENTION_BACKENDS:
            fail("runtime.attention_backend", self.attention_backend,
                 f"choose one of {', '.join(ATTENTION_BACKENDS)}")
        if not isinstance(self.batch_invariant, bool):
            fail("runtime.batch_invariant", self.batch_invariant, "pass True or False")
        if self.batch_invariant and self.compile:
            fail("runtime.compile", self.compile, "compiled layers choose their GEMMs by the row count, so "
                 "batch_invariant=True runs them uncompiled: pass compile=None or False")
        for name in ("cuda_graphs", "compile"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), bool):
                fail(f"runtime.{name}", getattr(self, name), "pass True, False or None (automatic)")
        for name in ("page_size", "max_cache_tokens", "max_batch_size"):
            value = getattr(self, name)
            if (value is not None or name == "page_size") and (not is_int(value) or value <= 0):
                fail(f"runtime.{name}", value, "pass a positive integer" + ("" if name == "page_size" else " or None"))
        if self.page_size & (self.page_size - 1):
            fail("runtime.page_size", self.page_size, "pass a power of two (16, 32, 64, ...)")
        tokens = self.prefix_cache_tokens
        if not is_int(tokens) or tokens < 0:
            fail("runtime.prefix_cache_tokens", tokens, "pass a number of tokens (0 turns the prefix store off)")


RUNTIME_FIELDS = tuple(field.name for field in dataclasses.fields(RuntimeOptions))


def with_runtime(fields: dict, runtime: RuntimeOptions | None = None) -> dict:
    """`fields` (keywords of a config) with the runtime options among them moved into `runtime` (theirs winning
    over the `runtime` given there, else over `runtime`, else over the defaults)."""
    flat = {name: fields[name] for name in RUNTIME_FIELDS if name in fields}
    if not flat:
        return fields
    rest = {name: value for name, value in fields.items() if name not in flat}
    base = rest.get("runtime", runtime)
    if base is not None and not isinstance(base, RuntimeOptions):
        fail("runtime", base, "pass a RuntimeOptions")
    return {**rest, "runtime": dataclasses.replace(base or RuntimeOptions(), **flat)}


def route_runtime_keywords(cls: type) -> None:
    """Wraps `cls.__init__` so that runtime options passed as keywords set those fields of its `runtime`."""
    init = cls.__init__

    @functools.wraps(init)
    def routing_init(self, *args, **kwargs):
        init(self, *args, **with_runtime(kwargs))

    cls.__init__ = routing_init


def moved_to_runtime(name: str) -> str:
    """The error of a runtime option read or set on the config itself, naming its new place."""
    return (f"BlockDiffusionConfig.{name} moved to BlockDiffusionConfig.runtime.{name} (a RuntimeOptions; "
            f"CHANGELOG.md, \"Moved\"): read config.runtime.{name}; change it with config.replace({name}=...) or a "
            f"{name}= keyword of the call")
