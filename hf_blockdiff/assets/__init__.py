"""Files that ship with the package: the tiny demo model (`hf-blockdiff train-tiny` reproduces it)."""

from pathlib import Path


def demo_model_path() -> Path:
    """Directory of the bundled demo checkpoint (SDAR, block size 4, character tokenizer)."""
    return Path(__file__).resolve().parent / "demo_model"
