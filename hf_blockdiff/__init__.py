"""hf_blockdiff: fast block-diffusion decoding inside Hugging Face transformers.

`import hf_blockdiff` registers the attention function and the released checkpoint families (SDAR, SDAR-MoE,
LLaDA, Dream, Fast-dLLM v2: `AutoModelForCausalLM.from_pretrained` loads them without remote code), and puts
`generate_multi_block` on them and on the stock Qwen2, Qwen3, Qwen3-MoE and Llama causal LMs; `patch_model(model)`
does the same for any other causal LM class.
"""

import importlib.abc
import sys

from . import attention as _attention
from .cache import PagedBlockCache
from .config import BlockDiffusionConfig, RuntimeOptions
from .generation import BlockDiffusionOutput
from . import patching as _patching
from .patching import BlockDiffusionGenerationMixin, free_cache, patch_model

__version__ = "0.1.0"
__all__ = [
    "BlockDiffusionConfig",
    "BlockDiffusionEvalCallback",
    "BlockDiffusionGenerationMixin",
    "BlockDiffusionOutput",
    "PagedBlockCache",
    "RuntimeOptions",
    "free_cache",
    "patch_model",
]

_attention.register()
_patching.patch_known_classes()

# modules that moved (CHANGELOG.md, "Moved"): importing the old name fails with the new one
MOVED = {"cache_keyword": "cache.keyword", "config_checks": "config.checks", "config_record": "config.record",
         "experts_capture": "fusion.capture", "lora": "weights.lora", "presets": "config.presets",
         "profiles": "config.profiles", "quantization": "weights.quantization", "scoring": "strategies.scoring",
         "tensor_parallel": "weights.tensor_parallel", "generation.canvas": "canvas.loop",
         "generation.fused_experts": "fusion.experts", "generation.fused_layers": "fusion.layers",
         "generation.fusion": "fusion.mode", "model_patches.diffusion_gemma": "canvas.diffusion_gemma",
         "model_patches.released_caches": "model_patches.released.caches",
         "model_patches.released_calls": "model_patches.released.calls",
         "model_patches.released_masks": "model_patches.released.masks", "scheduler.canvas": "canvas.schedule"}


class _MovedModules(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        old = fullname.removeprefix(f"{__name__}.")
        if old in MOVED:
            raise ImportError(f"{fullname} moved to {__name__}.{MOVED[old]} (CHANGELOG.md, \"Moved\"): import it "
                              "from there", name=fullname)
        return None


sys.meta_path.insert(0, _MovedModules())


def __getattr__(name: str):
    if name == "BlockDiffusionEvalCallback":  # imported on first use: it brings in the Trainer machinery
        from .integrations.callbacks import BlockDiffusionEvalCallback

        return BlockDiffusionEvalCallback
    raise AttributeError(f"module 'hf_blockdiff' has no attribute {name!r}")
