"""Compiled decoder layers in two regions around their attention (fusion/regions.py): a fused Qwen-style layer is
traced as `before_attention` and `after_attention`, whole, and nothing else of the layer, and decodes the tokens of
the same fused layers uncompiled."""

import torch
from torch._dynamo.utils import clear_compilation_metrics, get_compilation_metrics

from hf_blockdiff import BlockDiffusionConfig, free_cache
from hf_blockdiff.fusion import regions

from helpers import MASK, left_pad, random_prompts


def _traced_regions(dynamic):
    """The regions under dynamo only (no inductor): what is traced, and that each traces whole (`fullgraph`, which
    the library leaves off so that an MLP breaking its graph degrades instead of failing), is what is tested."""
    return tuple(torch.compile(region, dynamic=dynamic, fullgraph=True, backend="eager")
                 for region in (regions.before_attention, regions.after_attention))


def test_fused_layers_compile_as_two_whole_regions_and_decode_the_uncompiled_tokens(qwen3, monkeypatch):
    monkeypatch.setattr(regions, "compiled_regions", _traced_regions)
    ids, mask = left_pad(random_prompts((11, 6), seed=3))
    cfg = BlockDiffusionConfig(mask_token_id=MASK, block_size=4, max_new_tokens=4, threshold=0.6, eos_token_id=[],
                               attention="block_causal", attention_backend="triton")
    free_cache(qwen3)
    uncompiled = qwen3.generate_multi_block(ids, cfg.replace(compile=False), attention_mask=mask)
    free_cache(qwen3)
    torch._dynamo.reset()
    clear_compilation_metrics()
    compiled = qwen3.generate_multi_block(ids, cfg.replace(compile=True), attention_mask=mask)
    free_cache(qwen3)
    traced = {metrics.co_name for metrics in get_compilation_metrics()}
    torch._dynamo.reset()  # the shared regions' cache entries: none left for later tests to count
    assert {"before_attention", "after_attention"} <= traced
    assert not traced & {"forward", "rotary_in_cache_attention_forward", "_attention", "attend"}, traced
    assert torch.equal(compiled, uncompiled)
