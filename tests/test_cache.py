"""PagedBlockCache: committed K/V equal a fresh full forward; pages are reused; the HF Cache API holds."""

import pytest
import torch

from hf_blockdiff import BlockDiffusionConfig, PagedBlockCache
from reference_loops import staircase

from helpers import MASK, left_pad, random_prompts


def committed_kv(model, row: int, length: int):
    cache = model._blockdiff_engine.cache
    positions = torch.arange(length)[None]
    slots = cache.slots(torch.tensor([row]), positions, torch.ones_like(positions, dtype=torch.bool))
    return [cache.dense(layer, slots) for layer in range(cache.num_layers)]


def fresh_kv(model, tokens: torch.Tensor, allowed: torch.Tensor):
    bias = torch.zeros(1, 1, len(tokens), len(tokens)).masked_fill(~allowed, torch.finfo(torch.float32).min)
    with torch.no_grad():
        out = model(input_ids=tokens[None], attention_mask=bias, position_ids=torch.arange(len(tokens))[None],
                    use_cache=True)
    return [(layer.keys, layer.values) for layer in out.past_key_values.layers]


@pytest.mark.parametrize("alignment,fused", [("absolute", False), ("absolute", True), ("prompt_end", True)])
def test_committed_kv_equal_a_fresh_forward(qwen3, alignment, fused):
    check_committed_kv(qwen3, alignment, fused, "sdpa")


def check_committed_kv(qwen3, alignment: str, fused: bool, backend: str):
    prompts = random_prompts((8, 5, 11), seed=4)
    block, new = 4, 13
    ids, mask = left_pad(prompts)
    cfg = BlockDiffusionConfig(mask_token_id=MASK, block_size=block, max_new_tokens=new, threshold=0.6,
                               attention="block_causal", alignment=alignment, fused_store=fused, eos_token_id=[],
                               attention_backend=backend)
    out = qwen3.generate_multi_block(ids, cfg, attention_mask=mask)
    committed = qwen3._blockdiff_engine.cache.committed.tolist()
    for row, prompt in enumerate(prompts):
        p = len(prompt)
        final = torch.cat([prompt, out[row, ids.shape[1]:]])
        start = 0 if alignment == "absolute" else p
        whole_blocks = start + (p + new - start) // block * block  # K/V beyond depend on positions past p + new
        length = min(committed[row], whole_blocks)
        assert length >= p  # the prompt and at least some generated blocks were committed
        expected = fresh_kv(qwen3, final[:whole_blocks], staircase(whole_blocks, p, block, alignment))
        for (k, v), (k_ref, v_ref) in zip(committed_kv(qwen3, row, length), expected):
            torch.testing.assert_close(k[0], k_ref[0, :, :length], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(v[0], v_ref[0, :, :length], rtol=1e-5, atol=1e-5)


def test_pages_are_reused_across_calls(qwen3):
    ids, mask = left_pad(random_prompts((6, 9), seed=1))
    cfg = BlockDiffusionConfig(mask_token_id=MASK, block_size=4, max_new_tokens=8, attention="block_causal",
                               eos_token_id=[])
    first = qwen3.generate_multi_block(ids, cfg, attention_mask=mask)
    cache = qwen3._blockdiff_engine.cache
    pool = cache.keys[0]
    second = qwen3.generate_multi_block(ids, cfg, attention_mask=mask)
    assert qwen3._blockdiff_engine.cache is cache and cache.keys[0] is pool
    assert torch.equal(first, second)


def test_rows_own_their_pages_and_commit_advances():
    cache = PagedBlockCache(num_layers=1, page_size=16)
    cache.start(2, 40, 5 * 16, torch.device("cpu"))
    assert cache.num_pages == 1 + 5 and cache.page_table.shape == (2, 3)
    first, second = cache.pages.take(3), cache.pages.take(2)
    cache.assign(0, first)
    cache.assign(1, second)
    assert cache.page_table[0].tolist() == first and cache.page_table[1, :2].tolist() == second
    assert 0 not in first + second and not set(first) & set(second) and cache.pages.take(1) is None
    cache.commit(torch.tensor([1]), torch.tensor([7]))
    assert cache.committed.tolist() == [0, 7] and cache.get_seq_length() == 7
    cache.crop(-5)
    assert cache.committed.tolist() == [0, 2]
    with pytest.raises(ValueError, match="negative"):
        cache.crop(3)


def test_pages_return_to_the_pool_with_their_last_reference():
    """A page shared by two rows (a prompt prefix) is free again only when both let go of it."""
    cache = PagedBlockCache(num_layers=1, page_size=4)
    cache.start(2, 8, 3 * 4, torch.device("cpu"))
    shared, own = cache.pages.take(1), cache.pages.take(2)
    cache.assign(0, shared + own[:1])
    cache.assign(1, shared + own[1:])
    assert cache.pages.in_use == 3 and cache.pages.take(1) is None
    cache.release(0)
    assert cache.pages.in_use == 2 and cache.pages.take(1) == own[:1]
    cache.release(1)
    assert cache.pages.in_use == 1 and cache.pages.peak == 3  # own[0], taken above and not assigned
    cache.reset_pages()
    assert cache.pages.in_use == 0 and (cache.page_table == 0).all()


def test_write_ahead_does_not_move_the_pointer(qwen3):
    """A read-only denoise forward writes its K/V into pages but leaves the committed length alone."""
    ids, mask = left_pad(random_prompts((8,), seed=2))
    cfg = BlockDiffusionConfig(mask_token_id=MASK, block_size=4, max_new_tokens=4, attention="block_causal",
                               fused_store=False, eos_token_id=[])
    qwen3.generate_multi_block(ids, cfg, attention_mask=mask)
    assert qwen3._blockdiff_engine.cache.committed.tolist() == [12]  # prompt 8 + one stored block of 4


def test_update_rotary_writes_what_update_writes():
    """K/V handed over as projected (q/k norms and rotary applied while writing) land where `update` puts the rotated
    ones; cos/sin broadcast over the rows (positions of one row shared by all) are taken as they are."""
    pytest.importorskip("triton")
    from hf_blockdiff.attention import resolve_backend
    from hf_blockdiff.kernels.rotary_write import rotary_write_reference

    backend = resolve_backend("triton", torch.device("cpu"), 4, 4)
    caches = [PagedBlockCache(num_layers=1, page_size=4) for _ in range(2)]
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, heads, 8, generator=generator) for heads in (4, 2, 2))  # [R, W, heads, D]
    angles = torch.arange(3.0)[None, :, None] * torch.linspace(0.1, 1.0, 8)
    cos, sin = angles.cos(), angles.sin()  # [1, W, D]
    weights = [1 + 0.1 * torch.randn(8, generator=generator) for _ in range(2)]
    plans = []
    for cache in caches:
        cache.start(2, 4, 2 * 4, torch.device("cpu"))
        cache.assign(0, cache.pages.take(1))
        cache.assign(1, cache.pages.take(1))
        positions = torch.arange(3).expand(2, -1)
        plans.append(backend.plan(cache, torch.arange(2), positions, torch.ones(2, 3, dtype=torch.bool),
                                  torch.full((2, 3), 3, dtype=torch.int32)))
    query, key, value = caches[0].update_rotary(*(t.transpose(1, 2) for t in (q, k, v)), 0, plans[0],
                                                (cos, sin, *weights, 1e-6))
    scratch = [torch.zeros(6, 2, 8) for _ in range(2)]
    flat = [t.reshape(6, -1, 8) for t in (q, k, v)]
    rows_cos, rows_sin = (t.expand(2, -1, -1).reshape(6, 8) for t in (cos, sin))
    expected_q = rotary_write_reference(*flat, rows_cos, rows_sin, *(s.view(6, 1, 2, 8) for s in scratch),
                                        torch.arange(6), *weights, eps=1e-6)
    caches[1].update(scratch[0].view(2, 3, 2, 8).transpose(1, 2), scratch[1].view(2, 3, 2, 8).transpose(1, 2), 0,
                     {"plan": plans[1]})
    assert key is None and value is None  # the triton backend reads the pools
    torch.testing.assert_close(query.transpose(1, 2).reshape(6, -1, 8), expected_q)
    torch.testing.assert_close(caches[0].keys[0], caches[1].keys[0])
    assert torch.equal(caches[0].values[0], caches[1].values[0])
