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


def test_moe_experts_equals_transformers_grouped_mm_forward(device):
    """transformers' own experts module (Qwen3-MoE's, `grouped_mm` forward) on the same routing, fp32."""
    from transformers import Qwen3MoeConfig
    from transformers.integrations.moe import grouped_mm_experts_forward
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    config = Qwen3MoeConfig(hidden_size=64, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2)
    x, index, weights, gate_up, down = routed(7, 8, 2, 64, 32, torch.float32, device, seed=5)
    experts = Qwen3MoeExperts(config).to(device)
    with torch.no_grad():
        experts.gate_up_proj.copy_(gate_up)
        experts.down_proj.copy_(down)
        expected = grouped_mm_experts_forward(experts, x, index, weights)
    torch.testing.assert_close(moe_experts(x, index, weights, gate_up, down, "silu"), expected, rtol=1e-5, atol=1e-5)


def test_moe_experts_rejects_bad_shapes(device):
    x, index, weights, gate_up, down = routed(3, 4, 2, 32, 16, torch.float32, device)
    with pytest.raises(ValueError, match="down must be"):
        moe_experts(x, index, weights, gate_up, down[:, :, :8], "silu")
    with pytest.raises(ValueError, match="act must be"):
        moe_experts(x, index, weights, gate_up, down, "relu")
    with pytest.raises(ValueError, match="hidden must be"):
        moe_experts(x[:, :16], index, weights, gate_up, down, "silu")
