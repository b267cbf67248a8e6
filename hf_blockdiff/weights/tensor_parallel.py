"""Tensor parallelism through transformers' `tp_plan="auto"` (docs/architecture.md, "Around the loop").

Under `torchrun`, `from_pretrained(..., tp_plan="auto")` shards q/k/v column-wise by heads, so each process's attention
sees its local heads and `PagedBlockCache.update` receives local K/V: the cache sizes its page pools from the first
`update`, so it holds the local KV heads without being told, and `kv_head_shards` tells the KV budget so. Every
process decodes every prompt (same tokens: the logits are gathered, or each process scores its vocabulary shard and
the scores are combined, `vocab_shard`), unlike data parallelism, which splits the prompts
(both at once: `integrations.distributed`).

transformers loads a model whose head counts do not divide the process count without complaint and then fails
inside the first attention with a bare reshape error; `check_tensor_parallel` says why before any forward (and
`shard_layout` before the model is built or loaded).

While decoding, `sharded_decoding` runs the sharded layers on their local shards as plain `nn.Linear` layers, so the
fused decode paths (`fusion/layers.py`) take them as they take a one-GPU model, runs the row-wise ones through an op
of our own, the product and its all-reduce (`all_reduce.row_parallel_linear`; docs/benchmarks.md, "Tensor
parallel"), and gives attentions and MLPs whose q/k/v and gate/up shards `load_sharded` packed side by side their
stacked weights (`packed_shards`).
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .all_reduce import row_parallel_linear, row_parallel_linear_norm, sums_for
from .packed_shards import stacked_projections
from .shard_layout import plan_style, sharded_dim

LOCAL_STYLES = ("colwise", "rowwise", "replicated_with_grad_allreduce")  # a gathered LM head keeps its forward
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
    uneven = {name: n for name in HEAD_COUNTS for n in per_layer_values(text, name) if isinstance(n, int) and n % size}
    if uneven:
        counts = ", ".join(f"{name}={n}" for name, n in uneven.items())
        raise ValueError(
            f"The model is sharded over {size} processes (tp_plan), but {counts} is not divisible by {size}: "
            "attention heads cannot be split evenly. Shard over a number of processes that divides the head counts "
            "(tensor_parallel_size / --tensor-parallel-size N, launched as torchrun --nproc_per_node N·M), or load "
            "without tp_plan and use data parallelism (accelerate launch)."
        )


def per_layer_values(config, name: str) -> list:
    """`name`'s value in `config`, or its value in each layer where transformers keeps it per layer (a heterogeneous
    config, transformers >= 5.2x, refuses to read such an attribute globally)."""
    try:
        return [getattr(config, name, None)]
    except Exception as error:
        if type(error).__name__ != "AmbiguousGlobalPerLayerAttributeError":
            raise
        return [getattr(layer, name, None) for layer in config.per_layer_config]


def kv_head_shards(model) -> int:
    """Processes the KV heads are split over: the tensor-parallel size when the plan splits the key projection
    (`k_proj`), else 1 (attention kept whole, as LLaDA2's fused `query_key_value`)."""
    size = tensor_parallel_size(model)
    plan = getattr(model, "tp_plan", None) or {}
    split = any(rule.rsplit(".", 1)[-1] == "k_proj" and sharded_dim(style, 2) is not None
                for rule, style in plan.items())
    return size if size > 1 and split else 1


SUMS = "blockdiff_partial_sums"  # a row-parallel layer's attribute inside `sharded_decoding`: the group it sums over


def row_parallel_forward(self, x: torch.Tensor) -> torch.Tensor:
    """The forward of a row-parallel `nn.Linear` on its local shard (bound to it inside `sharded_decoding`): the
    partial product, summed over the ranks, then the bias once. One function for every layer (an object per layer
    would be a guard per layer to torch.compile, and a recompile at each)."""
    return row_parallel_product(self, x, skinny=False)


def row_parallel_product(linear: torch.nn.Linear, x: torch.Tensor, skinny: bool, invariant: bool = False,
                         residual: torch.Tensor | None = None) -> torch.Tensor:
    """A row-parallel layer's output for x [..., K]: this rank's product summed over the ranks
    (`all_reduce.row_parallel_linear`: `skinny` and `invariant` its product's kernel), then the bias; plus `residual`
    [..., N] where given (added with the sum)."""
    flat = None if residual is None else residual.reshape(-1, residual.shape[-1])
    out = row_parallel_linear(x.reshape(-1, x.shape[-1]), linear.weight, getattr(linear, SUMS), skinny, invariant, flat)
    out = out.view(*x.shape[:-1], out.shape[-1])
    return out if linear.bias is None else out + linear.bias


def row_parallel_norm(linear: torch.nn.Linear, x: torch.Tensor, residual: torch.Tensor,
                      norm: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """(residual + a row-parallel layer's output for x, `norm`'s RMSNorm of it) through the skinny GEMM's product
    (`all_reduce.row_parallel_linear_norm`); a layer without bias, a norm with `weight` and `variance_epsilon`."""
    hidden, normed = row_parallel_linear_norm(x.reshape(-1, x.shape[-1]), linear.weight, getattr(linear, SUMS), True,
                                              False, residual.reshape(-1, residual.shape[-1]), norm.weight,
                                              norm.variance_epsilon)
    return hidden.view(residual.shape), normed.view(residual.shape)


def row_parallel(module: torch.nn.Module) -> bool:
    """Whether the module runs `row_parallel_forward` (inside `sharded_decoding`, which sets both): read from its
    group attribute, a plain string torch.compile reads as a constant (it must: a fused forward traced into a
    compiled layer branches on it, and a wrong branch skips the sum)."""
    return isinstance(getattr(module, SUMS, None), str)


# (id(owner), name) -> (a weak reference to the owner, the parameter made for it); an entry leaves with its owner
# (tensors compare elementwise, so no WeakKeyDictionary)
_REUSED: dict[tuple[int, str], tuple[weakref.ref, torch.nn.Parameter]] = {}


def _reused(owner, name: str, tensor: torch.Tensor) -> torch.nn.Parameter:
    """`tensor` as a plain parameter sharing its storage, the same object at every call while `owner` lives and the
    tensor stays where it is (graphs captured on it stay valid): a DTensor parameter's local shard, a module's stacked
    projections (`packed_shards`)."""
    key = (id(owner), name)
    ref, param = _REUSED.get(key, (None, None))
    if ref is None or ref() is not owner or param.data_ptr() != tensor.data_ptr() or param.shape != tensor.shape:
        param = torch.nn.Parameter(tensor.detach(), requires_grad=False)
        _REUSED[key] = (weakref.ref(owner, lambda _: _REUSED.pop(key, None)), param)
    return param


def _local(param) -> torch.nn.Parameter:
    """`param`'s local shard as a plain parameter sharing its storage."""
    return _reused(param, "local", param.to_local())


def agreed_seeds(model, seeds: torch.Tensor) -> torch.Tensor:
    """A tensor-parallel model's sampling seeds (`seeds`, one a row, drawn by this process) as the first process of its
    group drew them: every process of a group decodes the same rows and must draw the same noise, or a process whose
    random state has moved on (or a generator seeded per process) would sample other tokens, and the group's
    forwards would part ways. One broadcast a call; a model on one GPU keeps its own."""
    if tensor_parallel_size(model) == 1:
        return seeds
    param = next((p for p in model.parameters() if hasattr(p, "device_mesh")), None)
    if param is None:
        raise ValueError(f"The model says it is sharded over {tensor_parallel_size(model)} processes (tp_size) but "
                         "holds no sharded (DTensor) parameter: load it with tp_plan, or without tp_size.")
    group = _group(param)
    shared = seeds.to(param.device, copy=True)  # where the group's backend takes tensors (NCCL: the GPU)
    dist.broadcast(shared, src=dist.get_global_rank(group, 0), group=group)
    return shared.to(seeds.device)


def _group(param):
    mesh = param.device_mesh
    return mesh.get_group() if mesh.ndim == 1 else mesh.get_group("tp")


def _local_swaps(model) -> list[tuple[torch.nn.Module, dict, str | None]]:
    """(module, its local parameters, the group a row-parallel one sums over, else None) for every module of a style
    in LOCAL_STYLES whose parameters are all DTensors (linear layers only, but for replicated norms)."""
    from torch.distributed.tensor import DTensor

    plan, swaps = model.tp_plan, []
    for name, module in model.named_modules():
        params = {key: p for key, p in module._parameters.items() if p is not None}
        if not params or "forward" not in vars(module) or not all(isinstance(p, DTensor) for p in params.values()):
            continue
        style = plan_style(plan, f"{name}.{next(iter(params))}")
        if (style not in LOCAL_STYLES
                or (type(module) is not torch.nn.Linear and style != "replicated_with_grad_allreduce")):
            continue
        group = sums_for(_group(params["weight"])) if style == "rowwise" else None
        swaps.append((module, {key: _local(p) for key, p in params.items()}, group))
    return swaps


@dataclass(frozen=True)
class VocabShard:
    """This process's rows of an LM head split by vocabulary over a group (transformers' `colwise_gather_output`
    gathers the logits of every row; `ModelExecutor.score` scores them where they are, shard by shard)."""

    head: torch.nn.Module
    first: int  # the token id of this process's first row
    group: object

    def weight(self) -> torch.nn.Parameter:
        return _local(self.head.weight)

    def gather(self, rows: torch.Tensor) -> torch.Tensor:
        """Every process's `rows` (same shape), stacked in the order of their vocabulary shards."""
        size = dist.get_world_size(self.group)
        out = rows.new_empty(size * rows.shape[0], *rows.shape[1:])  # as gloo takes it: along the first dimension
        dist.all_gather_into_tensor(out, rows.contiguous(), group=self.group)
        return out.view(size, *rows.shape)


def vocab_shard(head: torch.nn.Module | None) -> VocabShard | None:
    """`head`'s vocabulary shard where tensor parallelism split its weight evenly by rows (no bias), else None."""
    weight = getattr(head, "weight", None)
    if not hasattr(weight, "placements") or getattr(head, "bias", None) is not None:  # not a DTensor
        return None
    from torch.distributed.tensor import Shard

    placements = list(weight.placements)
    if placements.count(Shard(0)) != 1 or not all(p == Shard(0) or p.is_replicate() for p in placements):
        return None
    group, rows = _group(weight), weight.to_local().shape[0]
    if rows * dist.get_world_size(group) != weight.shape[0]:
        return None
    return VocabShard(head, dist.get_rank(group) * rows, group)


def layer_stacks(model) -> list[tuple[torch.nn.Module, torch.nn.ModuleList]]:
    """(the module whose forward runs them, the layers) for each list of the model's repeated decoder layers: every
    ModuleList with one module per hidden layer (DiffusionGemma has two, its encoder's and its decoder's)."""
    count = model.config.get_text_config().num_hidden_layers
    return [(module, child) for module in model.modules() for child in module.children()
            if isinstance(child, torch.nn.ModuleList) and len(child) == count]


@contextmanager
def sharded_decoding(model):
    """A tensor-parallel model's sharded layers as plain layers on their local shards for the block (module
    docstring), attentions and MLPs given their q/k/v and gate/up stacked where the shards lie side by side
    (`packed_shards.stacked_projections`); their DTensor parameters and transformers' forwards restored after, also
    when the block raises. Layers of other styles (a gathered LM head, experts) keep transformers' forwards."""
    swaps = _local_swaps(model) if tensor_parallel_size(model) > 1 else []
    saved = [(module, dict(module._parameters), vars(module)["forward"]) for module, _, _ in swaps]
    stacks = []
    try:
        for module, params, group in swaps:
            module._parameters.update(params)
            del module.forward
            if group is not None:
                setattr(module, SUMS, group)
                module.forward = row_parallel_forward.__get__(module)
        stacks = [(module, {name: _reused(module, name, view) for name, view in views.items()})
                  for module, views in (stacked_projections(model) if swaps else [])]
        for module, params in stacks:
            module._parameters.update(params)
        yield
    finally:
        for module, params in stacks:
            for name in params:
                module._parameters.pop(name, None)
        for module, params, forward in saved:
            module._parameters.update(params)
            module.forward = forward
            vars(module).pop(SUMS, None)
