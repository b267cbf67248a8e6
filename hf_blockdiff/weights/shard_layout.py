"""What tensor parallelism makes of a model before it is built or loaded (docs/architecture.md, "Around the loop"):
`shard_layout` reads the tp_plan off a copy on the meta device, which weights are split and how many bytes each
process will hold; `check_shards` refuses uneven splits, `check_fits` a model the GPU cannot hold."""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field

FIT_SHARE = 0.9  # of a GPU's free memory the weights may take: the rest is for the KV cache and activations


def sharded_dim(style: str, ndim: int) -> int | None:
    """The dimension a tp_plan style splits a weight of `ndim` dimensions along (None: kept whole on every process).
    Column-wise styles split the output features (`[out, in]` Linear weights, `[experts, 2·I, H]` fused experts),
    row-wise ones the input features (a row-wise bias is added after the reduction, whole), embeddings the vocabulary."""
    if "colwise" in style:
        return max(ndim - 2, 0)
    if style == "embedding_rowwise":
        return 0
    return ndim - 1 if "rowwise" in style and ndim > 1 else None


def generic_name(name: str) -> str:
    """A module or parameter name as a plan names it: layer numbers as `*` (`layers.3.mlp` -> `layers.*.mlp`)."""
    return re.sub(r"\.\d+(?=\.|$)", ".*", name)


def plan_style(plan: dict[str, str], name: str) -> str | None:
    """The plan's style for parameter `name`: its own rule, else its module's (`layers.*` numbers any layer)."""
    owner = name.rsplit(".", 1)[0]
    rules = _rule_patterns(tuple(plan.items()))
    for candidate in (name, owner):
        for pattern, style in rules:
            if pattern.fullmatch(candidate):
                return style
    return None


@functools.lru_cache(maxsize=16)
def _rule_patterns(rules: tuple[tuple[str, str], ...]) -> tuple[tuple[re.Pattern, str], ...]:
    """A plan's rules compiled once (`sharded_decoding` matches every sharded layer's name at each call)."""
    return tuple((re.compile(re.escape(rule).replace(r"\*", r"\d+")), style) for rule, style in rules)


@dataclass
class ShardLayout:
    """Bytes each process holds of a model sharded over `size` processes, and the weights that cannot split evenly."""

    size: int
    sharded: int = 0  # bytes per process of the split weights
    replicated: int = 0  # bytes of the weights every process holds whole
    whole_sharded: int = 0  # bytes of the split weights, all processes together
    splits: set[int] = field(default_factory=set)  # lengths the plan divides by the process count
    uneven: dict[str, str] = field(default_factory=dict)  # rule (layer numbers as *) -> why
    wide: int = 0  # bytes of the weights wider than 2 bytes an element

    @property
    def per_rank(self) -> int:
        return self.sharded + self.replicated

    def ranks_needed(self, free: int) -> int | None:
        """The fewest processes, dividing every split length, whose GPUs of `free` bytes each hold the weights (None:
        no count does)."""
        room = FIT_SHARE * free - self.replicated
        if room <= 0:
            return None
        least = max(self.size, -(-self.whole_sharded // int(room)))
        return next((n for n in range(least, max(self.splits, default=least) + 1)
                     if all(length % n == 0 for length in self.splits)), None)


def shard_layout(model, size: int) -> ShardLayout:
    """What `tp_plan="auto"` over `size` processes makes of `model` (on the meta device, or already built)."""
    plan, layout = getattr(model, "tp_plan", None) or {}, ShardLayout(size)
    for name, parameter in model.named_parameters():
        nbytes = parameter.numel() * parameter.element_size()
        layout.wide += nbytes if parameter.element_size() > 2 else 0
        style = plan_style(plan, name) if size > 1 else None
        dim = None if style is None else sharded_dim(style, parameter.dim())
        if dim is None:
            layout.replicated += nbytes
            continue
        length = parameter.shape[dim] // 2 if style.startswith("packed") else parameter.shape[dim]  # [gate | up]
        layout.splits.add(length)
        if length % size:
            rule = generic_name(name)
            layout.uneven[rule] = f"{rule} ({parameter.shape[dim]} along dimension {dim}, {style})"
        layout.sharded += nbytes // size
        layout.whole_sharded += nbytes
    return layout


def check_shards(layout: ShardLayout) -> None:
    """A ValueError before anything is built when a weight the plan splits does not divide by the process count."""
    if layout.uneven:
        even = [n for n in range(2, max(layout.splits) + 1) if all(length % n == 0 for length in layout.splits)][:3]
        raise ValueError(f"tensor_parallel_size={layout.size} does not divide the weights tp_plan splits: "
                         f"{'; '.join(layout.uneven.values())}. Pass a tensor_parallel_size (--tensor-parallel-size, "
                         f"torchrun --nproc_per_node) that divides them: {', '.join(map(str, even))}, ...")


def check_fits(layout: ShardLayout, free: int, device: str = "the GPU") -> None:
    """A ValueError when the weights a process holds exceed `FIT_SHARE` of its GPU's `free` bytes, saying how much they
    need and how many processes would hold them."""
    if layout.per_rank <= FIT_SHARE * free:
        return
    needed = layout.ranks_needed(free)
    more = (f"shard over {needed} GPUs (--tensor-parallel-size {needed}, torchrun --nproc_per_node {needed})"
            if needed else "no number of GPUs holds it (the weights every GPU keeps whole do not fit alone)")
    smaller = ", or load it in bfloat16 (--dtype bfloat16)" if 2 * layout.wide > layout.replicated + layout.whole_sharded else ""
    raise ValueError(
        f"The model needs {layout.per_rank / 1e9:.1f} GB of weights per GPU with tensor_parallel_size={layout.size} "
        f"({layout.sharded / 1e9:.1f} GB of its shards + {layout.replicated / 1e9:.1f} GB kept whole on every GPU), "
        f"but {device} has {free / 1e9:.1f} GB free (the weights may take {FIT_SHARE:.0%}; the rest is for the KV "
        f"cache): {more}{smaller}.")


def local_weight_bytes(model) -> int:
    """Bytes of the weights this process holds (its shards of the split ones)."""
    local = (p.to_local() if hasattr(p, "to_local") else p for p in model.parameters())
    return sum(p.numel() * p.element_size() for p in local)
