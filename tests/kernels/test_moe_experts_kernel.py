import pytest
import torch

from hf_blockdiff.kernels.moe_experts import moe_experts, moe_experts_reference

pytest.importorskip("triton")


def routed(tokens, experts, top_k, hidden, inner, dtype, device, seed=0, unused=()):
    """Random hidden states, weights, and a routing that leaves the `unused` experts without pairs."""
    generator = torch.Generator().manual_seed(seed)
    x = 2 * torch.randn(tokens, hidden, generator=generator)
    gate_up = torch.randn(experts, 2 * inner, hidden, generator=generator) / hidden ** 0.5
    down = torch.randn(experts, hidden, inner, generator=generator) / inner ** 0.5
    allowed = torch.tensor([e for e in range(experts) if e not in unused])
    scores = torch.rand(tokens, len(allowed), generator=generator)
    index = allowed[scores.topk(top_k, dim=-1).indices]
    weights = torch.softmax(torch.randn(tokens, top_k, generator=generator), -1)
    return [t.to(device) for t in (x.to(dtype), index, weights, gate_up.to(dtype), down.to(dtype))]


@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("tokens, experts, top_k", [(3, 8, 2), (40, 4, 2), (5, 16, 4)])
def test_moe_experts_matches_the_reference(device, poisoned, act, tokens, experts, top_k):
    """Experts with no pair (skipped), with more pairs than a row tile (40 tokens over 4 experts), fp32 exact to
    the summation order."""
    x, index, weights, gate_up, down = routed(tokens, experts, top_k, 96, 48, torch.float32, device, unused=(1,))
    out = moe_experts(x, index, weights, gate_up, down, act)
    expected = moe_experts_reference(x.double(), index, weights.double(), gate_up.double(), down.double(), act)
    assert out.shape == x.shape and out.dtype == x.dtype
    tolerance = 2e-6 if device == "cpu" else 2e-5  # GPUs' exp is an approximation
    torch.testing.assert_close(out.double(), expected, rtol=tolerance / 2, atol=tolerance)


def test_moe_experts_rounds_as_transformers_bf16(device, poisoned, assert_close):
    x, index, weights, gate_up, down = routed(6, 8, 2, 128, 64, torch.bfloat16, device, seed=3)
    out = moe_experts(x, index, weights, gate_up, down, "silu")
    expected = moe_experts_reference(x, index, weights, gate_up, down, "silu")
    assert out.dtype == torch.bfloat16
    assert_close(out, expected.double(), torch.bfloat16)


def transformers_forward(x, index, weights, gate_up, down, hidden_act="silu"):
    """transformers' own experts module (Qwen3-MoE's) with these weights, through its `grouped_mm` forward."""
    from transformers import Qwen3MoeConfig
    from transformers.integrations.moe import grouped_mm_experts_forward
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    config = Qwen3MoeConfig(hidden_size=gate_up.shape[2], moe_intermediate_size=down.shape[2],
                            num_experts=gate_up.shape[0], num_experts_per_tok=index.shape[1], hidden_act=hidden_act)
    experts = Qwen3MoeExperts(config).to(gate_up.device, gate_up.dtype)
    with torch.no_grad():
        experts.gate_up_proj.copy_(gate_up)
        experts.down_proj.copy_(down)
        return grouped_mm_experts_forward(experts, x, index, weights)


def test_moe_experts_equals_transformers_grouped_mm_forward(device):
    """transformers' own experts module (Qwen3-MoE's, `grouped_mm` forward) on the same routing, fp32."""
    x, index, weights, gate_up, down = routed(7, 8, 2, 64, 32, torch.float32, device, seed=5)
    expected = transformers_forward(x, index, weights, gate_up, down)
    torch.testing.assert_close(moe_experts(x, index, weights, gate_up, down, "silu"), expected, rtol=1e-5, atol=1e-5)


def bf16_ulps(a, b):
    """How many bfloat16 values lie between a and b, elementwise (signed-magnitude bits to a monotone integer)."""
    def ordinal(t):
        bits = t.view(torch.int16).int()
        return torch.where(bits < 0, -(bits & 0x7FFF), bits)

    return (ordinal(a) - ordinal(b)).abs()


@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_many_pairs_match_the_reference(device, poisoned, act):
    """More pairs than the kernel's GEMMs take (300 over 4 experts): torch's grouped GEMM between the counting sort
    and the gathering weighted sum, one expert without pairs."""
    from hf_blockdiff.kernels.moe_experts import few_pairs

    x, index, weights, gate_up, down = routed(150, 4, 2, 96, 48, torch.float32, device, unused=(2,))
    assert not few_pairs(150, 2, 4)
    out = moe_experts(x, index, weights, gate_up, down, act)
    expected = moe_experts_reference(x.double(), index, weights.double(), gate_up.double(), down.double(), act)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize(("act", "weight_dtype"), [("silu", torch.bfloat16), ("gelu_tanh", torch.float32)])
def test_many_pairs_equal_transformers_grouped_mm_forward_bf16(device, act, weight_dtype):
    """transformers' own `grouped_mm` forward in bfloat16 (the same grouped GEMMs): equal but for rare differences of
    a few ulps. A gated value may differ by one ulp (the kernel's exponential is not torch's), which the down
    projection carries into its outputs, and with fp32 routing weights the fp32 sum's order differs."""
    x, index, weights, gate_up, down = routed(200, 4, 2, 64, 32, torch.bfloat16, device, seed=7)
    weights = weights.to(weight_dtype)
    expected = transformers_forward(x, index, weights, gate_up, down,
                                    "silu" if act == "silu" else "gelu_pytorch_tanh")
    out = moe_experts(x, index, weights, gate_up, down, act)
    ulps = bf16_ulps(out, expected)
    assert ulps.max() <= 4 and (ulps > 0).float().mean() < 0.01


def test_many_pairs_without_a_grouped_gemm_are_refused(device, monkeypatch):
    from hf_blockdiff.kernels import moe_experts as module

    monkeypatch.setattr(module, "GROUPED_MM", None)
    x, index, weights, gate_up, down = routed(150, 4, 2, 32, 16, torch.float32, device)
    assert not module.computes(150, 2, 4) and module.computes(3, 2, 4)
    with pytest.raises(ValueError, match="grouped GEMM"):
        moe_experts(x, index, weights, gate_up, down, "silu")


def test_compiled_calls_of_few_and_many_pairs_share_one_graph(device):
    """Traced by torch.compile with dynamic sizes (as the compiled layers of an MoE run it), the op's checks read the
    token count only where torch has no grouped GEMM: calls on either side of the few-pairs threshold trace one graph
    (a guard on it recompiled DiffusionGemma's layers when a call's prompts crossed it)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    compiled = torch.compile(moe_experts, dynamic=True, backend="eager", fullgraph=True)
    graphs = []
    for tokens in (3, 5, 150):  # 6, 10 and 300 pairs over 4 experts: the threshold is 128
        before = counters["stats"]["unique_graphs"]
        x, index, weights, gate_up, down = routed(tokens, 4, 2, 32, 16, torch.float32, device)
        torch.testing.assert_close(compiled(x, index, weights, gate_up, down, "silu"),
                                   moe_experts(x, index, weights, gate_up, down, "silu"))
        graphs.append(counters["stats"]["unique_graphs"] - before)
    assert graphs == [1, 0, 0], graphs


def test_many_pairs_are_captured_only_where_the_grouped_gemm_reads_nothing_back(monkeypatch):
    """bfloat16 on compute capability 9.0 and 10.0 (torch's CUTLASS grouped GEMM); other dtypes and GPUs loop over the
    groups with their sizes read on the host, which a CUDA graph cannot capture; off CUDA nothing is captured."""
    from types import SimpleNamespace

    from hf_blockdiff.kernels import moe_experts as module

    capability = [(9, 0)]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability[0])
    gpu = lambda dtype: SimpleNamespace(device=torch.device("cuda", 0), dtype=dtype)  # noqa: E731
    assert module.grouped_mm_captures(gpu(torch.bfloat16))
    assert not module.grouped_mm_captures(gpu(torch.float32)) and not module.grouped_mm_captures(gpu(torch.float16))
    capability[0] = (10, 0)
    assert module.grouped_mm_captures(gpu(torch.bfloat16))
    for other in ((8, 0), (8, 9), (12, 0)):
        capability[0] = other
        assert not module.grouped_mm_captures(gpu(torch.bfloat16))
    assert module.grouped_mm_captures(torch.zeros(1))
    monkeypatch.setattr(module, "GROUPED_MM", None)
    assert not module.grouped_mm_captures(torch.zeros(1))


def test_moe_experts_rejects_bad_shapes(device):
    x, index, weights, gate_up, down = routed(3, 4, 2, 32, 16, torch.float32, device)
    with pytest.raises(ValueError, match="down must be"):
        moe_experts(x, index, weights, gate_up, down[:, :, :8], "silu")
    with pytest.raises(ValueError, match="act must be"):
        moe_experts(x, index, weights, gate_up, down, "relu")
    with pytest.raises(ValueError, match="hidden must be"):
        moe_experts(x[:, :16], index, weights, gate_up, down, "silu")
    with pytest.raises(ValueError, match="top_k_weights must be"):
        moe_experts(x, index, weights.double(), gate_up, down, "silu")
    with pytest.raises(ValueError, match="top_k_weights must be"):
        moe_experts(x, index, weights[:, :1], gate_up, down, "silu")


@pytest.mark.parametrize("tokens, experts, top_k", [(3, 8, 2), (700, 64, 8), (1100, 64, 8), (5, 300, 4)])
def test_group_by_expert_is_a_stable_sort(device, poisoned, tokens, experts, top_k):
    """The counting sort against torch's stable sort, over several of its chunks (700 x 8 pairs in chunks of 1,024,
    1,100 x 8 in chunks of 4,096), with experts that no pair chose."""
    from hf_blockdiff.kernels.moe_experts import group_by_expert, group_by_expert_reference

    index = routed(tokens, experts, top_k, 8, 8, torch.float32, device, seed=tokens, unused=(0, 5))[1]
    grouped = group_by_expert(index.reshape(-1), experts)
    expected = group_by_expert_reference(index.reshape(-1), experts)
    assert all(torch.equal(got, want) for got, want in zip(grouped, expected, strict=True))  # order, offsets, position
    order, _, position = grouped
    assert torch.equal(order[position.long()], torch.arange(order.shape[0], device=device, dtype=order.dtype))


@pytest.mark.parametrize("dtype, weight_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                                 (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16)])
@pytest.mark.parametrize("gathered", [False, True])
def test_weighted_sum_rounds_as_transformers(device, poisoned, dtype, weight_dtype, gathered):
    """transformers' weighting and top-k sum: products in the promoted dtype, the sum in fp32 in order: bit for bit
    the reference, and transformers' own ops where the products are 16-bit (their sum in fp32 is then exact in any
    order); fp32 products summed in torch's order may differ in the last bit of the fp32 sum."""
    from hf_blockdiff.kernels.moe_experts import weighted_sum, weighted_sum_reference

    generator = torch.Generator().manual_seed(11)
    pair_out = (3 * torch.randn(40 * 6, 1000, generator=generator)).to(dtype).to(device)
    weights = torch.softmax(torch.randn(40, 6, generator=generator), -1).to(weight_dtype).to(device)
    if gathered:  # each pair's row where a grouping put it: the same sums
        position = torch.randperm(40 * 6, generator=generator).int().to(device)
        moved = torch.empty_like(pair_out)
        moved[position.long()] = pair_out
        out = weighted_sum(moved, weights, position)
        assert torch.equal(out, weighted_sum_reference(moved, weights, position))
    else:
        out = weighted_sum(pair_out, weights)
        assert torch.equal(out, weighted_sum_reference(pair_out, weights))
    transformers = (pair_out * weights.reshape(-1, 1)).view(40, 6, -1).sum(dim=1).to(dtype)
    if weight_dtype == torch.float32:  # fp32 rounding of 6 terms in another order, then one ulp of the output dtype
        terms = (pair_out.float().abs() * weights.reshape(-1, 1)).view(40, 6, -1).sum(dim=1)
        bound = 6 * torch.finfo(torch.float32).eps * terms + torch.finfo(dtype).eps * transformers.float().abs()
        assert ((out.float() - transformers.float()).abs() <= bound).all()
    else:
        assert torch.equal(out, transformers)
