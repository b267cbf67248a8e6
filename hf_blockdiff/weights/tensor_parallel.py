"""Tensor parallelism through transformers' `tp_plan="auto"` (docs/architecture.md, "Around the loop").

Under `torchrun`, `from_pretrained(..., tp_plan="auto")` shards q/k/v column-wise by heads, so each process's attention
sees its local heads and `PagedBlockCache.update` receives local K/V: the cache sizes its page pools from the first
`update`, so it holds the local KV heads without being told. Every process decodes every prompt (same tokens: the
logits are gathered), unlike data parallelism, which splits the prompts (both at once:
`integrations.distributed`).

transformers loads a model whose head counts do not divide the process count without complaint and then fails
inside the first attention with a bare reshape error; `check_tensor_parallel` says why before any forward.
"""

from __future__ import annotations

# the last: the KV heads of Gemma 4's (so DiffusionGemma's) full-attention layers
HEAD_COUNTS = ("num_attention_heads", "num_key_value_heads", "num_global_key_value_heads")


def tensor_parallel_size(model) -> int:
    """Processes the model's weights are sharded over (1 when not tensor-parallel)."""
    return getattr(model, "tp_size", None) or 1


def check_tensor_parallel(model) -> None:
    size = tensor_parallel_size(model)
    if size > 1:
        check_head_counts(model.config, size)


def check_head_counts(config, size: int) -> None:
    """A ValueError naming the fix unless `size` processes split the (text) config's attention heads evenly."""
    text = config.get_text_config()
    heads = {name: getattr(text, name, None) for name in HEAD_COUNTS}
    uneven = {name: n for name, n in heads.items() if isinstance(n, int) and n % size}
    if uneven:
        counts = ", ".join(f"{name}={n}" for name, n in uneven.items())
        raise ValueError(
            f"The model is sharded over {size} processes (tp_plan), but {counts} is not divisible by {size}: "
            "attention heads cannot be split evenly. Shard over a number of processes that divides the head counts "
            "(tensor_parallel_size / --tensor-parallel-size N, launched as torchrun --nproc_per_node N·M), or load "
            "without tp_plan and use data parallelism (accelerate launch)."
        )
