"""PEFT adapters at full speed: merge the LoRA layers into the base weights for a `generate_multi_block` call, then
put the base weights back bit-exactly (docs/architecture.md, "Around the loop").

Merging adds each adapter's delta to its base layer's `weight` (and `bias` with `lora_bias`); unmerging subtracts it
again, which does not give the original bits back in bf16. So the tensors merging overwrites are backed up first and
restored after the call, also when generation raises. The backup costs one copy of every adapted weight.

peft stays optional: a model carries LoRA layers only once peft was imported, so nothing here imports it otherwise.
"""

from __future__ import annotations

import functools
import inspect
import sys
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from .quantization import is_quantized_weight


def tuner_layers(model: torch.nn.Module) -> list:
    """The PEFT tuner layers (LoRA, ...) inside `model`; a `PeftModel`'s base model holds the same layers."""
    if sys.modules.get("peft") is None:
        return []
    from peft.tuners.tuners_utils import BaseTunerLayer

    return [module for module in model.modules() if isinstance(module, BaseTunerLayer)]


def layer_adapters(layer) -> set[str]:
    return {name for attr in layer.adapter_layer_names for name in getattr(layer, attr).keys()}


def check_adapters(layers: list, adapters) -> list[str | None]:
    """The runs of one call: `[None]` (the active adapters, if any) or the adapter names, validated up front."""
    if adapters is None:
        return [None]
    if isinstance(adapters, str) or not all(isinstance(a, str) for a in adapters):
        raise TypeError(f"adapters={adapters!r}: pass a list of adapter names, e.g. adapters=['default'].")
    if not adapters:
        raise ValueError("adapters=[] names no adapter: pass adapter names, or leave adapters=None.")
    if not layers:
        raise ValueError(
            f"adapters={adapters!r} needs a model carrying PEFT adapters (a PeftModel, or adapters loaded with "
            "model.load_adapter); this model has none."
        )
    available = sorted(set().union(*(layer_adapters(layer) for layer in layers)))
    missing = [a for a in adapters if a not in available]
    if missing:
        raise ValueError(f"adapters={adapters!r}: this model carries no adapter named {', '.join(missing)}; "
                         f"available: {', '.join(available)}.")
    merged = sorted({a for layer in layers for a in layer.merged_adapters})
    if merged:
        raise ValueError(
            f"Adapter(s) {merged} are already merged into the base weights, so no other adapter can be evaluated "
            "alone: call model.unmerge_adapter() first, or leave adapters=None."
        )
    if any(layer.disable_adapters for layer in layers):
        raise ValueError("adapters=[...] was given while the adapters are disabled (inside disable_adapter()?).")
    return list(adapters)


@dataclass
class _LayerBackup:
    """What merging changes on one tuner layer: its base parameters' tensors and values, and its bookkeeping."""

    layer: object
    params: list[tuple[torch.nn.Parameter, torch.Tensor, torch.Tensor]]  # (parameter, its tensor, a copy of it)
    bookkeeping: dict

    @classmethod
    def take(cls, layer, weights: bool) -> "_LayerBackup":
        base = layer.get_base_layer()
        tensors = (base.weight, getattr(base, "bias", None)) if weights else ()
        params = [(p, p.data, p.detach().clone()) for p in tensors if p is not None]
        names = ("merged_adapters", "_active_adapter", "_caches")
        return cls(layer, params, {n: _copy(getattr(layer, n)) for n in names if hasattr(layer, n)})

    def restore(self) -> None:
        with torch.no_grad():
            for param, tensor, values in self.params:
                tensor.copy_(values)
                param.data = tensor  # a merge that replaced the tensor (safe_merge, DoRA) gets the original back
        for name, value in self.bookkeeping.items():
            setattr(self.layer, name, value)


def _copy(value):
    return value.copy() if isinstance(value, (list, dict)) else value


def _to_merge(layer, adapter: str | None) -> list[str]:
    if adapter is not None:
        return [adapter] if adapter in layer_adapters(layer) else []
    if layer.disable_adapters:
        return []  # the layer runs its base weights only
    return [a for a in layer.active_adapters if a in layer_adapters(layer) and a not in layer.merged_adapters]


@contextmanager
def merged(layers: list, adapter: str | None):
    """Within the block the base weights of `layers` hold `adapter` merged in (None: each layer's active adapters);
    after it they hold exactly what they held before."""
    backups = []
    try:
        for layer in layers:
            names = _to_merge(layer, adapter)
            if adapter is None and not names:
                continue
            if names and is_quantized_weight(layer.get_base_layer().weight):
                raise ValueError(f"LoRA pre-merge: the base weights under adapter(s) {names} are quantized "
                                 f"({type(layer.get_base_layer().weight).__name__}); merging into them cannot be "
                                 "undone exactly. Merge into an unquantized copy (merge_and_unload) and quantize "
                                 "that, or disable the adapters for this call.")
            backups.append(_LayerBackup.take(layer, weights=bool(names)))
            if adapter is not None:
                layer._active_adapter = [adapter]  # a layer without it must not add the active adapter's delta
            if names:
                layer.merge(adapter_names=names)
        yield
    finally:
        for backup in reversed(backups):
            backup.restore()


def over_adapters(generate):
    """Wrap `generate_multi_block`: the model's LoRA layers are merged for the call (`merged`); with
    `adapters=[name, ...]` the call runs once per adapter, alone, and returns the outputs in that order."""

    @functools.wraps(generate)
    def generate_multi_block(model, *args, adapters: list[str] | None = None, **kwargs):
        layers = tuner_layers(model)
        outputs = []
        for adapter in check_adapters(layers, adapters):
            with merged(layers, adapter):
                outputs.append(generate(model, *args, **kwargs))
        return outputs if adapters is not None else outputs[0]

    signature = inspect.signature(generate)
    adapters = inspect.Parameter("adapters", inspect.Parameter.KEYWORD_ONLY, default=None)
    named = [p for p in signature.parameters.values() if p.kind is not p.VAR_KEYWORD]
    variadic = [p for p in signature.parameters.values() if p.kind is p.VAR_KEYWORD]  # **kwargs stays last
    generate_multi_block.__signature__ = signature.replace(parameters=[*named, adapters, *variadic])
    return generate_multi_block
