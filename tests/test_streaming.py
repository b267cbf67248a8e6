"""Prompt streaming and fixed-shape (CUDA-graph) steps give exactly the tokens of one plain batch."""

import pytest
import torch

from hf_blockdiff import BlockDiffusionConfig, free_cache
from hf_blockdiff.generation.graphs import capacity_buckets

from helpers import MASK, left_pad, random_prompts

MODES = {
    "fused": dict(attention="block_causal", alignment="absolute"),
    "store_forward": dict(attention="block_causal", alignment="absolute", fused_store=False),
    "multi_block": dict(attention="block_causal", alignment="prompt_end", logit_shift=True, max_active_blocks=3,
                        block_add_threshold=0.5, decoded_token_threshold=0.5, strategy="entropy_threshold",
                        threshold=1.2),
    "bidirectional": dict(attention="bidirectional", alignment="prompt_end"),
    "multi_block_bidirectional": dict(attention="bidirectional", alignment="prompt_end", max_active_blocks=3,
                                      block_add_threshold=0.5, decoded_token_threshold=0.5,
                                      strategy="entropy_threshold", threshold=1.0, forced_token_scope="all_active"),
    "dual_cache": dict(attention="bidirectional", alignment="prompt_end", approx_cache="dual"),
    "fast_dllm_v2": dict(attention="block_causal", alignment="absolute", logit_shift=True, fused_store=False,
                         first_token_on_store=True, sub_block_size=2, strategy="confidence_threshold"),
}


def run(model, prompts, **kwargs):
    ids, mask = left_pad(prompts)
    batch = kwargs.pop("max_batch_size", None)
    cfg = BlockDiffusionConfig(**{"mask_token_id": MASK, "block_size": 4, "max_new_tokens": 10, "threshold": 0.6,
                                  **kwargs})
    return model.generate_multi_block(ids, cfg, attention_mask=mask, return_dict=True, max_batch_size=batch,
                                      generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("mode", sorted(MODES))
def test_streaming_and_fixed_shapes_match_one_batch(qwen3, mode):
    prompts = random_prompts((9, 4, 6, 12, 3, 7, 5), seed=21)
    settings = dict(eos_token_id=[7, 11], pad_token_id=0, **MODES[mode])
    plain = run(qwen3, prompts, **settings)
    for variant in (dict(max_batch_size=3), dict(cuda_graphs=True), dict(max_batch_size=2, cuda_graphs=True)):
        other = run(qwen3, prompts, **settings, **variant)
        assert torch.equal(other.sequences, plain.sequences), variant
        torch.testing.assert_close(other.logprobs, plain.logprobs)  # other batch shapes: float rounding only
        torch.testing.assert_close(other.entropies, plain.entropies)
        assert torch.equal(other.commit_step >= 0, plain.commit_step >= 0)
        if "max_batch_size" not in variant:  # chained fixed-shape steps count no idle forward at a chain's end
            assert other.num_forwards == plain.num_forwards
    free_cache(qwen3)


def test_sampling_does_not_depend_on_the_batch_size(qwen3):
    prompts = random_prompts((9, 4, 6, 12, 3), seed=22)
    settings = dict(attention="block_causal", eos_token_id=[], temperature=0.9)
    assert torch.equal(run(qwen3, prompts, **settings).sequences,
                       run(qwen3, prompts, max_batch_size=2, **settings).sequences)


def test_engine_is_reused_and_freed(qwen3):
    prompts = random_prompts((6, 5), seed=23)
    run(qwen3, prompts, attention="block_causal", eos_token_id=[])
    engine = qwen3._blockdiff_engine
    run(qwen3, prompts, attention="block_causal", eos_token_id=[])
    assert qwen3._blockdiff_engine is engine
    free_cache(qwen3)
    assert qwen3._blockdiff_engine is None


def test_capacity_buckets():
    assert capacity_buckets(1, 2) == [1, 2]
    assert capacity_buckets(128, 256) == list(range(128, 257, 16))
    assert capacity_buckets(4, 30)[-1] == 30


def test_bad_batch_size(qwen3):
    with pytest.raises(ValueError, match="max_batch_size=0"):
        run(qwen3, random_prompts((5,)), attention="block_causal", max_batch_size=0)
