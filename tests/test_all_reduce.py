"""Which kernel sums a row-parallel layer's product (weights/all_reduce.py): NCCL for a decode step's small
messages and beyond the symmetric buffer, torch's two-shot kernel between. The kernels themselves run on two GPUs
(test_distributed.py, `test_row_parallel_sums_on_gpus_are_exact`)."""

import pytest
import torch

from hf_blockdiff.kernels.rmsnorm import rms_norm_reference
from hf_blockdiff.weights import all_reduce as all_reduce_module
from hf_blockdiff.weights.all_reduce import BACKEND_BYTES, TWO_SHOT_BYTES, Sums, kind_of


def test_kinds_by_size_dtype_and_buffer():
    sizes = (32 * 1024, BACKEND_BYTES, BACKEND_BYTES + 16, TWO_SHOT_BYTES, TWO_SHOT_BYTES + 16)
    assert [kind_of(size, torch.bfloat16, True) for size in sizes] == [
        "backend", "backend", "two_shot", "two_shot", "backend"]
    assert kind_of(2 * BACKEND_BYTES, torch.float32, True) == "two_shot"
    assert kind_of(2 * BACKEND_BYTES, torch.float16, True) == "backend"  # torch's kernel takes bf16 and fp32 only
    assert kind_of(2 * BACKEND_BYTES, torch.bfloat16, False) == "backend"  # gloo, or no symmetric memory


def backend_sums(monkeypatch, first: bool, other: torch.Tensor) -> tuple[Sums, list]:
    """A group of two ranks summing over the backend (no symmetric buffer, no process group), as rank 0 (`first`)
    or rank 1: its all-reduce adds `other`, the other rank's tensor, in place; the pointers it summed."""
    summed = []

    def all_reduce(tensor, group=None):
        summed.append(tensor.data_ptr())
        tensor.add_(other)

    monkeypatch.setattr(all_reduce_module.dist, "all_reduce", all_reduce)
    sums = Sums.__new__(Sums)
    sums.group, sums.name, sums.buffer, sums.carries_residual = None, f"rank-{int(not first)}", None, first
    monkeypatch.setitem(all_reduce_module._SUMS, sums.name, sums)
    return sums, summed


def test_the_backend_sums_the_product_it_made_in_place(monkeypatch):
    """Over NCCL or gloo, `row_parallel_linear` sums the product it computed in place (no copy in between) and returns
    it; x and the weight are left as they were. Two ranks holding the same product: the sum doubles it."""
    x, weight = torch.randn(3, 8), torch.randn(5, 8)
    product = torch.nn.functional.linear(x, weight)
    sums, summed = backend_sums(monkeypatch, True, product)
    kept = x.clone(), weight.clone()
    out = all_reduce_module.row_parallel_linear(x, weight, sums.name, False, False)
    torch.testing.assert_close(out, 2 * product)
    assert summed == [out.data_ptr()]
    assert torch.equal(x, kept[0]) and torch.equal(weight, kept[1])


@pytest.mark.parametrize("skinny", [False, True], ids=["cublas", "skinny"])
@pytest.mark.parametrize("first", [True, False], ids=["rank0", "rank1"])
def test_the_first_rank_carries_the_residual_into_the_backend_sum(monkeypatch, first, skinny):
    """With the residual stream, the first rank's product carries it (in the product's launch: cuBLAS's addmm, the
    skinny GEMM's residual epilogue) and the other's does not, so the sum holds it once, on every rank; with the norm,
    the op returns the sum and its RMSNorm as transformers' layer computes them."""
    x, weight, residual, norm = torch.randn(3, 8), torch.randn(5, 8), torch.randn(3, 5), torch.rand(5) + 0.5
    product = torch.nn.functional.linear(x, weight)
    sums, summed = backend_sums(monkeypatch, first, product if first else residual + product)  # the other rank's
    out = all_reduce_module.row_parallel_linear(x, weight, sums.name, skinny, False, residual)
    torch.testing.assert_close(out, residual + 2 * product)
    assert summed == [out.data_ptr()]
    hidden, normed = all_reduce_module.row_parallel_linear_norm(x, weight, sums.name, skinny, False, residual, norm,
                                                                1e-6)
    torch.testing.assert_close(hidden, residual + 2 * product)
    torch.testing.assert_close(normed, rms_norm_reference(residual + 2 * product, norm, 1e-6))
