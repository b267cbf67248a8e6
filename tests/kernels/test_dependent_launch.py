"""Programmatic dependent launch: on where the GPU has it, and a chain of dependent kernels replayed in a CUDA graph
reads what each kernel before it wrote."""

import pytest
import torch

from hf_blockdiff.kernels.dependent_launch import GDC_AVAILABLE, dependent_launch, launch_options
from hf_blockdiff.kernels.paged_attention import paged_attention, paged_attention_reference
from hf_blockdiff.kernels.rotary_write import rotary_write, rotary_write_reference
from hf_blockdiff.kernels.skinny_gemm import grouped_linear, grouped_linear_reference

pytest.importorskip("triton")


def test_off_on_cpu():
    assert not dependent_launch(torch.device("cpu"))
    assert launch_options(False) == {}  # Triton before 3.4 refuses a launch_pdl keyword, even False


def _layer(project, rotate, attend, x, weights, cos, sin, pools, slots, page_table, limits):
    """q/k/v projection → norms, rotary and cache write → attention → output projection, as one decode layer."""
    q, k, v = (t.view(len(x), -1, 64) for t in project(x, weights[:3], [None] * 3))
    query = rotate(q, k, v, cos, sin, *pools, slots, weights[4], weights[5], 1e-6)
    attended = attend(query.view(1, -1, 8, 64).transpose(1, 2), *pools, page_table, limits, 0.125)
    return project(attended.reshape(len(x), -1), weights[3:4], [None])[0]


@pytest.mark.gpu
def test_dependent_chain_in_a_cuda_graph_gpu():
    hopper = torch.cuda.get_device_capability()[0] >= 9 and torch.version.hip is None
    assert dependent_launch(torch.device("cuda")) == (hopper and GDC_AVAILABLE)
    generator = torch.Generator().manual_seed(0)
    dims = [(512, 256), (128, 256), (128, 256), (256, 512), (64,), (64,)]
    weights = [(torch.randn(*d, generator=generator) * (0.05 if len(d) > 1 else 1)).cuda().bfloat16() for d in dims]
    x = torch.randn(8, 256, generator=generator).cuda().bfloat16()
    angles = torch.arange(8.0)[:, None] * torch.linspace(0.01, 1.0, 64)
    cos, sin = angles.cos().cuda().bfloat16(), angles.sin().cuda().bfloat16()
    pools = [torch.zeros(4, 16, 2, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    page_table = torch.tensor([[1, 2, 3]], device="cuda", dtype=torch.int32)
    slots = torch.arange(16, 24, device="cuda")
    limits = torch.full((1, 8), 24, device="cuda", dtype=torch.int32)
    args = (x, weights, cos, sin, pools, slots, page_table, limits)
    kernels = (grouped_linear, rotary_write, paged_attention)
    references = (grouped_linear_reference, rotary_write_reference, paged_attention_reference)
    out = _layer(*kernels, *args)  # compiles every kernel before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _layer(*kernels, *args)
    for step in range(5):  # new inputs each replay: a kernel reading before its predecessor wrote would show
        x.copy_(torch.randn(8, 256, generator=generator).bfloat16())
        pools[0][1:].normal_()
        graph.replay()
        expected = _layer(*references, *args)
        torch.testing.assert_close(out.float(), expected.float(), atol=0.05, rtol=0.05)
