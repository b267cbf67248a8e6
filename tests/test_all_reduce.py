"""Which kernel sums a row-parallel layer's partial output (weights/all_reduce.py): NCCL for a decode step's small
messages and beyond the symmetric buffer, torch's two-shot kernel between. The kernels themselves run on two GPUs
(test_distributed.py, `test_partial_sums_on_gpus_are_exact`)."""

import torch

from hf_blockdiff.weights.all_reduce import BACKEND_BYTES, TWO_SHOT_BYTES, kind_of


def test_kinds_by_size_dtype_and_buffer():
    sizes = (32 * 1024, BACKEND_BYTES, BACKEND_BYTES + 16, TWO_SHOT_BYTES, TWO_SHOT_BYTES + 16)
    assert [kind_of(size, torch.bfloat16, True) for size in sizes] == [
        "backend", "backend", "two_shot", "two_shot", "backend"]
    assert kind_of(2 * BACKEND_BYTES, torch.float32, True) == "two_shot"
    assert kind_of(2 * BACKEND_BYTES, torch.float16, True) == "backend"  # torch's kernel takes bf16 and fp32 only
    assert kind_of(2 * BACKEND_BYTES, torch.bfloat16, False) == "backend"  # gloo, or no symmetric memory
