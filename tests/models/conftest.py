import pytest

from hf_blockdiff.model_patches import register_all


@pytest.fixture(autouse=True, scope="session")
def registered_families():
    register_all()
