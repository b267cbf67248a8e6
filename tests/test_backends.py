"""Attention backends: the Triton paged kernel gives the tokens of the sdpa reference in every decoding mode."""

import pytest
import torch

from hf_blockdiff import BlockDiffusionConfig
from hf_blockdiff.attention import available_backends, resolve_backend

from helpers import MASK, left_pad, random_prompts

MODES = {
    "sdar": dict(attention="block_causal", alignment="absolute", fused_store=False),
    "fused": dict(attention="block_causal", alignment="absolute"),
    "multi_block": dict(attention="block_causal", alignment="prompt_end", logit_shift=True, max_active_blocks=3,
                        block_add_threshold=0.5, decoded_token_threshold=0.5),
    "bidirectional": dict(attention="bidirectional", alignment="prompt_end"),
    "multi_block_bidirectional": dict(attention="bidirectional", alignment="prompt_end", max_active_blocks=3,
                                      block_add_threshold=0.5, decoded_token_threshold=0.5,
                                      strategy="entropy_threshold", forced_token_scope="all_active"),
    "dual_cache": dict(attention="bidirectional", alignment="prompt_end", approx_cache="dual"),
    "guidance": dict(attention="bidirectional", alignment="prompt_end", cfg_scale=1.0),
}


@pytest.mark.parametrize("mode", sorted(MODES))
def test_triton_equals_sdpa(qwen3, mode):
    ids, mask = left_pad(random_prompts((9, 4, 6), seed=12))
    base = BlockDiffusionConfig(mask_token_id=MASK, block_size=4, max_new_tokens=8, threshold=0.6, eos_token_id=[],
                                **MODES[mode])
    outputs = [
        qwen3.generate_multi_block(ids, base.replace(attention_backend=backend), attention_mask=mask, return_dict=True)
        for backend in ("sdpa", "triton")
    ]
    assert torch.equal(outputs[0].sequences, outputs[1].sequences)
    assert outputs[0].num_forwards == outputs[1].num_forwards


def test_backend_resolution():
    cpu = torch.device("cpu")
    assert resolve_backend("auto", cpu, 4, 64).name == "sdpa"
    assert "triton" in available_backends(cpu)  # under TRITON_INTERPRET=1, as the tests run
    with pytest.raises(ValueError, match="attention_backend=.flash_attn. is not available on cpu: install FlashAttention"):
        resolve_backend("flash_attn", cpu, 4, 64)


def test_compiled_layers_equal_eager_layers_and_are_restored(qwen3):
    """torch.compile'd decoder layers (inductor, dynamic shapes: one compilation serves prefill and every window)
    give the eager tokens; after the call the layers are the model's own again."""
    ids, mask = left_pad(random_prompts((9, 4, 6), seed=13))
    base = BlockDiffusionConfig(mask_token_id=MASK, block_size=4, max_new_tokens=8, threshold=0.6, eos_token_id=[],
                                **MODES["multi_block"])
    eager, compiled = (
        qwen3.generate_multi_block(ids, base.replace(compile=flag), attention_mask=mask, return_dict=True)
        for flag in (False, True)
    )
    assert torch.equal(eager.sequences, compiled.sequences)
    assert all("forward" not in vars(layer) for layer in qwen3.model.layers)
