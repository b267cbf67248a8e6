import pytest
import torch

from hf_blockdiff.kernels import INTERPRETED
from hf_blockdiff.kernels import rotary_write as rotary_write_module
from hf_blockdiff.kernels.rotary_write import rotary_write, rotary_write_reference

pytest.importorskip("triton")


def _inputs(device, dtype, tokens, q_heads, kv_heads, dim, normed, seed, pages=6, page_size=4):
    generator = torch.Generator().manual_seed(seed)
    projected = [torch.randn(tokens, heads * dim, generator=generator).to(device, dtype).view(tokens, heads, dim)
                 for heads in (q_heads, kv_heads, kv_heads)]  # views of projections, as the q/k/v GEMMs give them
    positions = torch.randint(0, 500, (tokens, 1), generator=generator).double()
    angles = positions / 10000 ** (torch.arange(0, dim, 2).double() / dim)
    angles = torch.cat([angles, angles], dim=-1)
    cos, sin = angles.cos().to(device, dtype), angles.sin().to(device, dtype)
    weights = [(1 + 0.2 * torch.randn(dim, generator=generator)).to(device, dtype) if normed else None
               for _ in range(2)]
    slots = torch.randperm(pages * page_size, generator=generator)[:tokens].to(device)
    pools = [torch.zeros(pages, page_size, kv_heads, dim, device=device, dtype=dtype) for _ in range(2)]
    return projected, cos, sin, weights, slots, pools


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("normed", [False, True])
@pytest.mark.parametrize("heads", [(4, 2, 64), (12, 3, 32), (1, 1, 96)])  # head groups, a non-power-of-two dim
def test_rotary_write_matches_fp64(device, poisoned, dtype, normed, heads, assert_close):
    (q, k, v), cos, sin, weights, slots, pools = _inputs(device, dtype, 9, *heads, normed, seed=sum(heads))
    out = rotary_write(q, k, v, cos, sin, *pools, slots, *weights, eps=1e-6)
    wide = [None if w is None else w.double() for w in weights]
    expected_pools = [torch.zeros_like(p, dtype=torch.float64) for p in pools]
    expected = rotary_write_reference(q.double(), k.double(), v.double(), cos.double(), sin.double(),
                                      *expected_pools, slots, *wide, eps=1e-6)
    assert out.shape == q.shape and out.dtype == dtype and out.is_contiguous()
    assert_close(out, expected, dtype)
    assert_close(pools[0], expected_pools[0], dtype)
    assert torch.equal(pools[1].double(), expected_pools[1])  # values are copied as they are
    written = torch.zeros(pools[0].numel() // (heads[1] * heads[2]), dtype=torch.bool, device=device)
    written[slots] = True
    assert (pools[0].view(len(written), -1)[~written] == 0).all()  # nothing outside the slots


@pytest.mark.skipif(not INTERPRETED, reason="compiled kernels run one token a program; blocks are the interpreter's")
@pytest.mark.parametrize("normed", [False, True])
def test_interpreted_token_blocks_equal_one_token_a_program(monkeypatch, normed):
    """Under TRITON_INTERPRET a program takes a block of tokens (two of 16 and a tail of 5 here): the queries and
    both pools bit for bit as with one token a program, the code GPUs run."""
    (q, k, v), cos, sin, weights, slots, _ = _inputs("cpu", torch.bfloat16, 37, 12, 3, 48, normed, seed=5, pages=12)
    results = []
    for block in (16, 1):
        monkeypatch.setattr(rotary_write_module, "INTERPRETED_TOKENS", block)
        pools = [torch.zeros(12, 4, 3, 48, dtype=torch.bfloat16) for _ in range(2)]
        results.append([rotary_write(q, k, v, cos, sin, *pools, slots, *weights, eps=1e-6), *pools])
    assert all(torch.equal(a, b) for a, b in zip(*results))
    assert results[0][1].view(-1, 3, 48)[slots].abs().sum(-1).gt(0).all()  # every token's keys written


@pytest.mark.parametrize("normed", [False, True])
def test_rotary_write_rounds_like_transformers(device, normed):
    """bf16: the kernel rounds each step as transformers' `Qwen3RMSNorm` and `apply_rotary_pos_emb` do (bit for bit
    but where the mean's fp32 summation order tips a rounding)."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, apply_rotary_pos_emb

    (q, k, v), cos, sin, weights, slots, pools = _inputs(device, torch.bfloat16, 16, 8, 2, 128, normed, seed=3)
    out = rotary_write(q, k, v, cos, sin, *pools, slots, *weights, eps=1e-6)
    if normed:
        norms = [Qwen3RMSNorm(128, eps=1e-6).to(device, torch.bfloat16) for _ in weights]
        for norm, weight in zip(norms, weights):
            norm.weight.data.copy_(weight)
        q, k = norms[0](q), norms[1](k)
    with torch.no_grad():  # transformers' layout: [tokens as batch, heads, 1, D] against cos/sin [tokens, 1, D]
        expected, key = (t[:, :, 0] for t in apply_rotary_pos_emb(q[:, :, None], k[:, :, None], cos[:, None],
                                                                     sin[:, None]))
    written = pools[0].view(-1, *pools[0].shape[2:])[slots]
    limit = 0.02 if normed else 0.0
    assert (out != expected).float().mean() <= limit and (written != key).float().mean() <= limit
    assert torch.equal(pools[1].view(-1, *pools[1].shape[2:])[slots], v)


def test_bad_shapes_are_refused():
    (q, k, v), cos, sin, _, slots, pools = _inputs("cpu", torch.float32, 5, 4, 2, 16, False, seed=0)
    with pytest.raises(ValueError, match="even D"):
        rotary_write(q, k[:, :, :8], v[:, :, :8], cos, sin, *pools, slots)
    with pytest.raises(ValueError, match=r"cos and sin must be \[5, 16\]"):
        rotary_write(q, k, v, cos[:4], sin[:4], *pools, slots)
    with pytest.raises(ValueError, match="page pools must be contiguous"):
        rotary_write(q, k, v, cos, sin, pools[0].transpose(0, 1), pools[1], slots)
    with pytest.raises(ValueError, match="query's heads and dims must be contiguous"):
        rotary_write(q.transpose(1, 2).contiguous().transpose(1, 2), k, v, cos, sin, *pools, slots)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [4, 640])
def test_sdar_4b_shapes_gpu(tokens):
    """SDAR-4B's heads (32 query, 8 KV, dim 128) at batch 1 and 128: transformers' rounding."""
    (q, k, v), cos, sin, weights, slots, pools = _inputs("cuda", torch.bfloat16, tokens, 32, 8, 128, True, seed=4,
                                                         pages=200, page_size=64)
    out = rotary_write(q, k, v, cos, sin, *pools, slots, *weights, eps=1e-6)
    reference_pools = [torch.zeros_like(p) for p in pools]
    expected = rotary_write_reference(q, k, v, cos, sin, *reference_pools, slots, *weights, eps=1e-6)
    assert (out != expected).float().mean() < 0.02 and (pools[0] != reference_pools[0]).float().mean() < 0.02
    assert torch.equal(pools[1], reference_pools[1])
