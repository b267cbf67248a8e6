from .mixin import BlockDiffusionGenerationMixin, BlockDiffusionOutput

__all__ = ["BlockDiffusionGenerationMixin", "BlockDiffusionOutput"]
