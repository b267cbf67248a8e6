"""The flash_attn backend's side of the contract: with FlashAttention stood in for by a module that checks each call
against FlashAttention's documented paged interface and computes it with `flash_paged_reference`, decoding gives the
sdpa tokens in every mode; bad page and block sizes are refused before any forward. (The real FlashAttention runs
on the GPU only: tests/test_gpu.py runs it where it is installed.)"""

import sys
import types

import pytest
import torch

from hf_blockdiff import BlockDiffusionConfig
from hf_blockdiff.attention.backends import FlashBackend
from hf_blockdiff.kernels import flash
from hf_blockdiff.kernels.paged_attention import paged_attention_reference

from helpers import MASK, left_pad, random_prompts
from test_backends import MODES
from test_cache import check_committed_kv


def stand_in(calls):
    def flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens, block_table, softmax_scale, causal):
        rows, _, heads, head_dim = q.shape
        assert q.stride(-1) == 1 and not causal
        assert k_cache.shape == v_cache.shape and k_cache.shape[3] == head_dim and heads % k_cache.shape[2] == 0
        assert cache_seqlens.shape == (rows,) and cache_seqlens.dtype == torch.int32 and bool((cache_seqlens > 0).all())
        assert block_table.shape[0] == rows and block_table.dtype == torch.int32 and block_table.stride(-1) == 1
        calls.append(rows)
        return flash.flash_paged_reference(q, k_cache, v_cache, cache_seqlens, block_table, softmax_scale)

    return flash_attn_with_kvcache


@pytest.fixture
def installed(monkeypatch):
    """Install a stand-in FlashAttention under `module_name` ("flash_attn_interface": FA3, "flash_attn": FA2)."""
    calls = []

    def install(module_name):
        module = types.ModuleType(module_name)
        module.flash_attn_with_kvcache = stand_in(calls)
        monkeypatch.setitem(sys.modules, module_name, module)
        flash.load.cache_clear()
        monkeypatch.setattr(FlashBackend, "runs_on", classmethod(lambda cls, device: True))  # the stand-in runs on CPU
        return calls

    yield install
    flash.load.cache_clear()


@pytest.mark.parametrize("mode", sorted(MODES))
def test_flash_backend_equals_sdpa(qwen3, installed, mode):
    calls = installed("flash_attn_interface")
    ids, mask = left_pad(random_prompts((9, 4, 6), seed=12))
    base = BlockDiffusionConfig(mask_token_id=MASK, block_size=4, max_new_tokens=8, threshold=0.6, eos_token_id=[],
                                **MODES[mode])
    outputs = [
        qwen3.generate_multi_block(ids, base.replace(attention_backend=backend), attention_mask=mask, return_dict=True)
        for backend in ("sdpa", "flash_attn")
    ]
    assert calls
    assert torch.equal(outputs[0].sequences, outputs[1].sequences)
    assert outputs[0].num_forwards == outputs[1].num_forwards


@pytest.mark.parametrize("alignment,fused", [("absolute", True), ("prompt_end", False)])
def test_flash_backend_commits_the_kv_of_a_fresh_forward(qwen3, installed, alignment, fused):
    installed("flash_attn_interface")
    check_committed_kv(qwen3, alignment, fused, "flash_attn")


def test_flash_reference_is_the_paged_attention_rule():
    """Every query of a row with one key length is the paged-attention reference with that length for all queries."""
    gen = torch.Generator().manual_seed(3)
    k_pages, v_pages = (torch.randn(9, 16, 2, 32, generator=gen, dtype=torch.float64) for _ in range(2))
    page_table = torch.randperm(9, generator=gen)[:8].view(2, 4).int()
    lengths = torch.tensor([37, 64], dtype=torch.int32)
    q = torch.randn(2, 4, 6, 32, generator=gen, dtype=torch.float64)
    out = flash.flash_paged_reference(q, k_pages, v_pages, lengths, page_table, 0.2)
    expected = paged_attention_reference(q.transpose(1, 2), k_pages, v_pages, page_table,
                                         lengths[:, None].expand(2, 4), 0.2)
    torch.testing.assert_close(out, expected)


def test_flash_attn_2_needs_pages_of_256(qwen3, installed):
    installed("flash_attn")
    ids = torch.randint(0, MASK, (1, 5))
    cfg = BlockDiffusionConfig(mask_token_id=MASK, block_size=4, max_new_tokens=8, attention="block_causal",
                               attention_backend="flash_attn")
    with pytest.raises(ValueError, match="page_size=64: flash-attn 2 reads pages of a multiple of 256 tokens"):
        qwen3.generate_multi_block(ids, cfg)
    assert torch.equal(qwen3.generate_multi_block(ids, cfg.replace(page_size=256)),
                       qwen3.generate_multi_block(ids, cfg.replace(page_size=256, attention_backend="sdpa")))


def test_flash_backend_refuses_blocks_it_cannot_chunk(qwen3, installed):
    installed("flash_attn_interface")
    cfg = BlockDiffusionConfig(mask_token_id=MASK, block_size=96, max_new_tokens=8, attention="block_causal",
                               attention_backend="flash_attn")
    with pytest.raises(ValueError, match="block_size=96: the flash_attn backend needs blocks of at most 64"):
        qwen3.generate_multi_block(torch.randint(0, MASK, (1, 5)), cfg)
