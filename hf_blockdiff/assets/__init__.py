"""Files that ship with the package: the tiny demo models (`hf-blockdiff train-tiny` reproduces them)."""

from pathlib import Path

_HERE = Path(__file__).resolve().parent
# name -> directory: "demo" (1.6 M parameters, the demo task family, trained on a CPU) and "hard" (11.4 M parameters,
# the hard task family, trained on a GPU); hf_blockdiff/tools/train_tiny.py says how each was made
BUNDLED_MODELS = {"demo": _HERE / "demo_model", "hard": _HERE / "hard_model"}


def demo_model_path() -> Path:
    """Directory of the bundled demo checkpoint (SDAR, block size 4, character tokenizer)."""
    return BUNDLED_MODELS["demo"]


def model_path(name: str) -> str:
    """The checkpoint directory a `--model` value names: a bundled model's name (`demo`, `hard`) or a directory
    (`./demo` is the directory)."""
    return str(BUNDLED_MODELS[name]) if name in BUNDLED_MODELS else name
