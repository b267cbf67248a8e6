"""Experts modules a CUDA graph cannot capture: named, graphs off by default, cuda_graphs=True refused (the check
reads the model only, before the engine exists, so it runs on CPU with the device given as CUDA)."""

from __future__ import annotations

import pytest
import torch

from diffusion_gemma_models import tiny_diffusion_gemma

from hf_blockdiff import BlockDiffusionConfig
from hf_blockdiff.attention.backends import TritonBackend
from hf_blockdiff.fusion.capture import experts_capture_blocker
from hf_blockdiff.generation.engine import use_graphs

CUDA = torch.device("cuda")


@pytest.mark.parametrize("name,dtype,implementation,reason", [
    ("mixed_moe", torch.float32, "grouped_mm", "torch.float32 weights"),
    ("mixed_moe", torch.bfloat16, "eager", "eager experts"),
    ("single_expert", torch.bfloat16, "grouped_mm", "a single expert"),
    ("mixed_moe", torch.bfloat16, "grouped_mm", None),
    ("single_expert", torch.float32, "batched_mm", None),
])
def test_experts_that_sync_are_named(name, dtype, implementation, reason):
    model = tiny_diffusion_gemma(name).to(dtype)
    model.set_experts_implementation(implementation)
    blocker = experts_capture_blocker(model)
    assert blocker is None if reason is None else reason in blocker
    backend = TritonBackend()
    assert use_graphs(BlockDiffusionConfig(), backend, CUDA, model) is (reason is None)
    if reason is None:
        assert use_graphs(BlockDiffusionConfig(cuda_graphs=True), backend, CUDA, model) is True
        return
    with pytest.raises(ValueError, match="cuda_graphs=True .*set_experts_implementation"):
        use_graphs(BlockDiffusionConfig(cuda_graphs=True), backend, CUDA, model)

