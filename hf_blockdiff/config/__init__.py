"""How a call decodes: `BlockDiffusionConfig` and its checks, the presets that reproduce reference decoders and the
profiles of the checkpoint families (model facts as data: no model code, no transformers)."""

from .block_diffusion import FALLBACKS, BlockDiffusionConfig
from .runtime import ATTENTION_BACKENDS, RuntimeOptions

__all__ = ["ATTENTION_BACKENDS", "FALLBACKS", "BlockDiffusionConfig", "RuntimeOptions"]
