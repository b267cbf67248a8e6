from .generate import BlockDiffusionOutput, generate_multi_block

__all__ = ["BlockDiffusionOutput", "generate_multi_block"]
