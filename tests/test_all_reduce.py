"""Which kernel sums a row-parallel layer's product (weights/all_reduce.py): NCCL for a decode step's small
messages and beyond the symmetric buffer, torch's two-shot kernel between. The kernels themselves run on two GPUs
(test_distributed.py, `test_row_parallel_sums_on_gpus_are_exact`)."""

import torch

from hf_blockdiff.weights import all_reduce as all_reduce_module
from hf_blockdiff.weights.all_reduce import BACKEND_BYTES, TWO_SHOT_BYTES, Sums, kind_of


def test_kinds_by_size_dtype_and_buffer():
    sizes = (32 * 1024, BACKEND_BYTES, BACKEND_BYTES + 16, TWO_SHOT_BYTES, TWO_SHOT_BYTES + 16)
    assert [kind_of(size, torch.bfloat16, True) for size in sizes] == [
        "backend", "backend", "two_shot", "two_shot", "backend"]
    assert kind_of(2 * BACKEND_BYTES, torch.float32, True) == "two_shot"
    assert kind_of(2 * BACKEND_BYTES, torch.float16, True) == "backend"  # torch's kernel takes bf16 and fp32 only
    assert kind_of(2 * BACKEND_BYTES, torch.bfloat16, False) == "backend"  # gloo, or no symmetric memory


def test_the_backend_sums_the_product_it_made_in_place(monkeypatch):
    """Over NCCL or gloo, `row_parallel_linear` sums the product it computed in place (no copy in between) and returns
    it; x and the weight are left as they were. Two ranks holding the same product: the sum doubles it."""
    summed = []

    def all_reduce(tensor, group=None):
        summed.append(tensor.data_ptr())
        tensor.mul_(2)

    monkeypatch.setattr(all_reduce_module.dist, "all_reduce", all_reduce)
    sums = Sums.__new__(Sums)  # a group with no symmetric buffer, without a process group
    sums.group, sums.name, sums.buffer = None, "two-ranks", None
    monkeypatch.setitem(all_reduce_module._SUMS, sums.name, sums)
    x, weight = torch.randn(3, 8), torch.randn(5, 8)
    kept = x.clone(), weight.clone()
    out = all_reduce_module.row_parallel_linear(x, weight, sums.name, False, False)
    torch.testing.assert_close(out, 2 * torch.nn.functional.linear(x, weight))
    assert summed == [out.data_ptr()]
    assert torch.equal(x, kept[0]) and torch.equal(weight, kept[1])
