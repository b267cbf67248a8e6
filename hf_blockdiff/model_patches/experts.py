"""MoE families whose checkpoints store every expert separately and whose models fuse them (SDAR-MoE, LLaDA2).

Released MoE checkpoints hold `layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight`; transformers' experts modules
(reused by our MoE classes) hold one stacked tensor per projection and stack the per-expert tensors while loading.
Two things follow:
- transformers runs the experts as grouped GEMMs (`experts_implementation="grouped_mm"`, its default where the GPU
  has them; graph-safe) only for a class whose *module source* shows `@use_experts_implementation`. Our modules reuse
  those experts classes without that text, so transformers would fall back to its eager loop over experts; the
  mixin says the class supports the choice.
- a missing or mis-shaped expert tensor surfaces as a failed `torch.stack` reported against the fused tensor; the
  mixin checks the checkpoint's headers first and names the tensor.
"""

from __future__ import annotations

import json
import os

from transformers import PreTrainedConfig

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def expert_shapes(config, moe_layers: list[int]) -> dict[str, tuple[int, int]]:
    """Every per-expert tensor a released checkpoint of `config` holds, with its shape (decoder-relative names)."""
    wide = (config.moe_intermediate_size, config.hidden_size)
    return {f"layers.{layer}.mlp.experts.{expert}.{projection}.weight": wide[::-1] if projection == "down_proj" else wide
            for layer in moe_layers for expert in range(config.num_experts) for projection in PROJECTIONS}


def checkpoint_shapes(directory: str) -> dict[str, tuple[int, ...]] | None:
    """Tensor name -> shape from the safetensors headers of a checkpoint directory (None: no safetensors there)."""
    from safetensors import safe_open

    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as file:
            files = sorted(set(json.load(file)["weight_map"].values()))
    elif os.path.isfile(os.path.join(directory, "model.safetensors")):
        files = ["model.safetensors"]
    else:
        return None
    shapes = {}
    for name in files:
        with safe_open(os.path.join(directory, name), framework="pt") as handle:
            shapes.update({key: tuple(handle.get_slice(key).get_shape()) for key in handle.keys()})
    return shapes


def check_expert_tensors(directory: str, expected: dict[str, tuple[int, int]]) -> None:
    """Raise `ValueError` naming the first expert tensor the checkpoint lacks or holds with another shape."""
    found = checkpoint_shapes(directory)
    if found is None:
        return
    for name, shape in expected.items():
        key = next((key for key in (f"model.{name}", name) if key in found), None)
        if key is None:
            raise ValueError(f"The checkpoint in {directory} has no expert tensor `model.{name}` (shape {shape}): "
                             "it is truncated or of another configuration; re-download or re-save it.")
        if found[key] != shape:
            raise ValueError(f"The checkpoint in {directory} holds `{key}` with shape {found[key]}, but its config "
                             f"(num_experts, hidden_size, moe_intermediate_size) asks for {shape}: the weights and "
                             "config.json do not belong together.")


class ReleasedExperts:
    """Mixin for our MoE model classes (put it first in the bases). A class sets `moe_layers`, a function of the config
    listing the layers with experts."""

    moe_layers: staticmethod

    @classmethod
    def _can_set_experts_implementation(cls) -> bool:  # transformers' hook; see the module docstring
        return True

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        path = args[0] if args else kwargs.get("pretrained_model_name_or_path")
        if isinstance(path, (str, os.PathLike)) and os.path.isdir(path):
            directory = os.path.join(path, kwargs["subfolder"]) if kwargs.get("subfolder") else str(path)
            config = kwargs.get("config")
            if not isinstance(config, PreTrainedConfig):
                config = cls.config_class.from_pretrained(directory)
            check_expert_tensors(directory, expert_shapes(config, cls.moe_layers(config)))
        return super().from_pretrained(*args, **kwargs)
