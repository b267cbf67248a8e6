"""hf_blockdiff: fast block-diffusion decoding inside Hugging Face transformers.

`import hf_blockdiff` registers the attention function and the released checkpoint families (SDAR, SDAR-MoE,
LLaDA, Dream, Fast-dLLM v2: `AutoModelForCausalLM.from_pretrained` loads them without remote code), and puts
`generate_multi_block` on them and on the stock Qwen2, Qwen3, Qwen3-MoE and Llama causal LMs; `patch_model(model)`
does the same for any other causal LM class.
"""

from . import attention as _attention
from .cache import PagedBlockCache
from .config import BlockDiffusionConfig
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
    "free_cache",
    "patch_model",
]

_attention.register()
_patching.patch_known_classes()


def __getattr__(name: str):
    if name == "BlockDiffusionEvalCallback":  # imported on first use: it brings in the Trainer machinery
        from .integrations.callbacks import BlockDiffusionEvalCallback

        return BlockDiffusionEvalCallback
    raise AttributeError(f"module 'hf_blockdiff' has no attribute {name!r}")
