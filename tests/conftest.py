import os

import pytest
import torch

if not torch.cuda.is_available():  # Triton kernels run in its interpreter; set before any kernel is defined
    os.environ.setdefault("TRITON_INTERPRET", "1")

from helpers import tiny_model  # noqa: E402


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` run on the device machine (`pytest -m gpu`); CI deselects them with -m "not gpu"."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device: run `python -m pytest -m gpu tests` on a GPU machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def qwen3():
    return tiny_model("qwen3")


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    from helpers import save_checkpoint

    return save_checkpoint(tmp_path_factory.mktemp("tiny-checkpoint"))
