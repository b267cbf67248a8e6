"""Which kernel sums a row-parallel layer's product (weights/all_reduce.py): our one-shot kernel for a decode step's
small messages, torch's two-shot kernel for mid-size ones, the backend (NCCL, gloo) beyond the symmetric buffer. The
op's one-shot path runs on CPU with ranks as forked processes under Triton's interpreter; the kernels themselves run on
two GPUs (test_distributed.py, `test_row_parallel_sums_on_gpus_are_exact`)."""

import pytest
import torch

from hf_blockdiff.kernels import INTERPRETED
from hf_blockdiff.kernels.one_shot_sum import PROGRAMS, one_shot_sum_reference
from hf_blockdiff.kernels.rmsnorm import rms_norm_reference
from hf_blockdiff.weights import all_reduce as all_reduce_module
from hf_blockdiff.weights.all_reduce import ONE_SHOT_BYTES, ONE_SHOT_MAX_WIDTH, TWO_SHOT_BYTES, Sums, kind_of
from helpers import one_shot_group, run_forked


def test_kinds_by_size_width_dtype_and_buffer():
    sizes = (32 * 1024, ONE_SHOT_BYTES, ONE_SHOT_BYTES + 16, TWO_SHOT_BYTES, TWO_SHOT_BYTES + 16)
    assert [kind_of(size, 4096, torch.bfloat16, True, True) for size in sizes] == [
        "one_shot", "one_shot", "two_shot", "two_shot", "backend"]
    assert kind_of(32 * 1024, 4096, torch.float32, True, True) == "one_shot"
    assert kind_of(32 * 1024, 4096, torch.bfloat16, True, False) == "backend"  # no Triton, or no room for flags
    assert kind_of(32 * 1024, 2 * ONE_SHOT_MAX_WIDTH, torch.bfloat16, True, True) == "backend"  # a row in registers
    assert kind_of(2 * ONE_SHOT_BYTES, 4096, torch.float32, True, True) == "two_shot"
    assert kind_of(2 * ONE_SHOT_BYTES, 4096, torch.float16, True, True) == "backend"  # torch's kernel: bf16, fp32
    assert kind_of(32 * 1024, 4096, torch.float16, True, True) == "backend"
    assert kind_of(32 * 1024, 4096, torch.bfloat16, False, True) == "backend"  # gloo, or no symmetric memory


def unbound_sums(name: str, rank: int, **fields) -> Sums:
    """A `Sums` of no process group, rank `rank` of two: the backend's path, or the one-shot path where `fields` give
    its buffer, slots, pads and epochs."""
    sums = Sums.__new__(Sums)
    sums.group, sums.name, sums.rank, sums.carries_residual = None, name, rank, rank == 0
    sums.buffer, sums.one_shot = None, False
    vars(sums).update(fields)
    return sums


def backend_sums(monkeypatch, first: bool, other: torch.Tensor) -> tuple[Sums, list]:
    """A group of two ranks summing over the backend (no symmetric buffer, no process group), as rank 0 (`first`)
    or rank 1: its all-reduce adds `other`, the other rank's tensor, in place; the pointers it summed."""
    summed = []

    def all_reduce(tensor, group=None):
        summed.append(tensor.data_ptr())
        tensor.add_(other)

    monkeypatch.setattr(all_reduce_module.dist, "all_reduce", all_reduce)
    sums = unbound_sums(f"rank-{int(not first)}", int(not first))
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


def _one_shot_rank(rank, shared, xs, weights, residual, norm, outs, skinny):
    """One rank of a group of `len(xs)` summing through `Sums`' one-shot path: its slots and the peers' are CPU memory
    shared across the fork (the op alone, with the residual and with the norm, call after call)."""
    slots, pads = shared
    sums = unbound_sums("one-shot", rank, one_shot=True, buffer=torch.zeros(0, dtype=torch.uint8), slots=slots,
                        pads=pads, epochs=torch.zeros(PROGRAMS, dtype=torch.int64))
    outs[rank][0].copy_(sums.linear(xs[rank], weights[rank], skinny, False))
    outs[rank][1].copy_(sums.linear(xs[rank], weights[rank], skinny, False, residual))
    hidden, normed = sums.linear_norm(xs[rank], weights[rank], skinny, False, residual, norm, 1e-6)
    outs[rank][2].copy_(hidden)
    outs[rank][3].copy_(normed)


@pytest.mark.skipif(not INTERPRETED, reason="ranks as forked CPU processes need Triton's interpreter; on GPUs the "
                    "two-process worker of test_distributed.py runs the op")
@pytest.mark.parametrize("skinny", [False, True], ids=["cublas", "skinny"])
def test_the_one_shot_path_sums_the_products_of_every_rank(skinny):
    """Two ranks' products (small integers in fp32: exact in any order; the skinny GEMM's or torch's) pushed into every
    rank's slots and summed by the one-shot kernel, the residual stream added where given and the RMSNorm after:
    every rank holds the reference's sums, call after call."""
    rows, width, k, world = 4, 24, 16, 2
    generator = torch.Generator().manual_seed(7)
    xs = [torch.randint(-4, 4, (rows, k), generator=generator).float() for _ in range(world)]
    weights = [torch.randint(-4, 4, (width, k), generator=generator).float() for _ in range(world)]
    residual = torch.randint(-4, 4, (rows, width), generator=generator).float()
    norm = torch.rand(width, generator=generator) + 0.5
    memory, pad_memory, slots, pads = one_shot_group(world, ONE_SHOT_BYTES)  # the memory held while the ranks run
    outs = [torch.zeros(4, rows, width).share_memory_() for _ in range(world)]
    run_forked(_one_shot_rank, [(r, (slots, pads), xs, weights, residual, norm, outs, skinny) for r in range(world)])
    products = [x @ w.T for x, w in zip(xs, weights)]
    plain, _ = one_shot_sum_reference(products)
    hidden, normed = one_shot_sum_reference(products, residual, norm, 1e-6)
    for rank in range(world):
        assert torch.equal(outs[rank][0], plain) and torch.equal(outs[rank][1], hidden)
        assert torch.equal(outs[rank][2], hidden)
        torch.testing.assert_close(outs[rank][3], normed, rtol=1e-6, atol=1e-6)
