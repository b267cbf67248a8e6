import pytest

from helpers import tiny_model


@pytest.fixture(scope="session")
def qwen3():
    return tiny_model("qwen3")
