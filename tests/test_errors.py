"""Bad input gets a ValueError naming the argument and the fix, before any forward; the model stays unchanged."""

import pytest
import torch

from hf_blockdiff import BlockDiffusionConfig

from helpers import MASK, left_pad, random_prompts, tiny_model


@pytest.fixture
def model():
    m = tiny_model("qwen3", seed=3)
    m.forwards = 0

    def count(*args, **kwargs):
        m.forwards += 1

    m.model.register_forward_pre_hook(count)
    return m


def snapshot(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def assert_unchanged(model, before):
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert model.config._attn_implementation == "sdpa"


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(block_size=0), r"block_size=0 .*positive integer"),
        (dict(block_size=-4), r"block_size=-4"),
        (dict(steps_per_block=0), r"steps_per_block"),
        (dict(strategy="nope"), r"strategy='nope'.*low_confidence_dynamic.*sequential"),
        (dict(threshold=1.5), r"threshold=1.5.*\[0.0, 1.0\]"),
        (dict(fallback="random"), r"fallback='random'.*topk, leftmost"),
        (dict(temperature=-1.0), r"temperature"),
        (dict(alignment="left"), r"alignment='left'.*absolute, prompt_end"),
        (dict(attention="causal"), r"attention='causal'.*block_causal, bidirectional"),
        (dict(attention_backend="cuda"), r"attention_backend='cuda'.*sdpa"),
        (dict(block_add_threshold=2.0), r"block_add_threshold"),
        (dict(eos_token_id="eos"), r"eos_token_id"),
        (dict(page_size=48), r"page_size=48.*power of two"),
        (dict(top_p=1.5), r"top_p=1.5 .*\(0, 1\]"),  # was read as top-p off
        (dict(top_p=0), r"top_p=0 .*\(0, 1\]"),
    ],
)
def test_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        BlockDiffusionConfig(**kwargs)


def call_fails(model, ids, cfg, match, error=ValueError, **kwargs):
    before = snapshot(model)
    with pytest.raises(error, match=match):
        model.generate_multi_block(ids, cfg, **kwargs)
    assert model.forwards == 0
    assert_unchanged(model, before)


def test_no_mask_token_anywhere(model):
    ids = torch.randint(0, 50, (1, 6))
    call_fails(model, ids, BlockDiffusionConfig(block_size=4, attention="block_causal"), r"mask_token_id")


def test_no_block_size_anywhere(model):
    ids = torch.randint(0, 50, (1, 6))
    call_fails(model, ids, BlockDiffusionConfig(mask_token_id=MASK, attention="block_causal"), r"block_size")


def test_no_profile_and_no_attention(model):
    ids = torch.randint(0, 50, (1, 6))
    call_fails(model, ids, BlockDiffusionConfig(mask_token_id=MASK, block_size=4), r"attention='block_causal'")


def test_mask_token_outside_the_vocabulary(model):
    ids = torch.randint(0, 50, (1, 6))
    cfg = BlockDiffusionConfig(mask_token_id=500, block_size=4, attention="block_causal")
    call_fails(model, ids, cfg, r"mask_token_id=500 .*vocabulary has 96")


def test_right_padding(model):
    ids, mask = left_pad(random_prompts((6, 3)))
    cfg = BlockDiffusionConfig(mask_token_id=MASK, block_size=4, attention="block_causal")
    call_fails(model, ids, cfg, r"left padding.*padding_side = 'left'", attention_mask=mask.flip(1))


def test_prompt_too_long_for_the_positions(model):
    ids = torch.randint(0, 50, (1, 500))
    cfg = BlockDiffusionConfig(mask_token_id=MASK, block_size=4, max_new_tokens=64, attention="block_causal")
    call_fails(model, ids, cfg, r"max_position_embeddings=512")


def test_empty_prompt_row(model):
    ids, mask = left_pad(random_prompts((4, 3)))
    mask[1] = 0
    cfg = BlockDiffusionConfig(mask_token_id=MASK, block_size=4, attention="block_causal")
    call_fails(model, ids, cfg, r"at least one prompt token", attention_mask=mask)


def test_wrong_types(model):
    with pytest.raises(TypeError, match="BlockDiffusionConfig"):
        model.generate_multi_block(torch.ones(1, 3, dtype=torch.long), {"block_size": 4})
    with pytest.raises(ValueError, match="LongTensor"):
        model.generate_multi_block(torch.ones(1, 3), BlockDiffusionConfig(mask_token_id=MASK, block_size=4, attention="block_causal"))
    assert model.forwards == 0


def test_config_from_model_profile(model):
    """Unset fields come from the model config (mask_token_id, block_size)."""
    model.config.mask_token_id, model.config.block_size = MASK, 4
    out = model.generate_multi_block(torch.randint(0, 50, (1, 6)), BlockDiffusionConfig(max_new_tokens=4))
    assert out.shape == (1, 10) and model.forwards > 0


def test_generation_leaves_weights_and_training_forward_unchanged(model):
    ids = torch.randint(0, 50, (2, 9))
    model.train()
    with torch.no_grad():
        before_logits = model(ids).logits
    before = snapshot(model)
    cfg = BlockDiffusionConfig(mask_token_id=MASK, block_size=4, max_new_tokens=8, attention="block_causal")
    model.generate_multi_block(ids, cfg)
    assert model.training
    assert_unchanged(model, before)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, before_logits, rtol=0, atol=0)


@pytest.mark.parametrize("field", ["temperature", "repetition_penalty", "threshold", "top_p", "cfg_scale"])
@pytest.mark.parametrize("value", [float("inf"), float("nan")])
def test_non_finite_settings_are_refused(field, value):
    """Such settings used to make no step commit anything, so the call never ended."""
    with pytest.raises(ValueError, match=f"BlockDiffusionConfig.{field}=.*pass a finite number"):
        BlockDiffusionConfig(**{field: value})


def test_sub_blocks_need_store_forwards():
    with pytest.raises(ValueError, match="sub_block_size=2 .*fused_store=False"):
        BlockDiffusionConfig(block_size=4, sub_block_size=2)


CFG = BlockDiffusionConfig(mask_token_id=MASK, block_size=4, max_new_tokens=8, attention="block_causal",
                           temperature=0.8)
REFUSED = {  # call arguments -> (error, message); each refused before any forward
    "empty_batch": (dict(input_ids=torch.zeros(0, 5, dtype=torch.long)), ValueError,
                    r"input_ids has shape \[0, 5\]: no prompt to decode"),
    "generator_seed": (dict(generator=123), TypeError,
                       r"generator=123 \(int\) is no torch.Generator: .*torch\.Generator\(\)\.manual_seed\(123\)"),
    "streamer_object": (dict(streamer=object()), TypeError,
                        r"streamer \(object\) has no put and no end method: .*BaseStreamer"),
    "compile_without_compiler": (dict(config=CFG.replace(compile=True)), ValueError,
                                 r"compile=True is invalid: torch.compile on the CPU needs a C\+\+ compiler"),
}


def normal_call(model):
    ids, mask = left_pad(random_prompts((5, 3), seed=4))
    return model.generate_multi_block(ids, CFG, attention_mask=mask, generator=torch.Generator().manual_seed(7))


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_a_refused_call_leaves_the_next_call_as_on_a_fresh_model(model, case):
    """Each crash reported in issue 35 is now a refusal naming the argument, before any forward; the model decodes
    next as a fresh one does."""
    kwargs, error, match = REFUSED[case]
    kwargs = dict(dict(input_ids=torch.randint(0, 50, (1, 6)), config=CFG), **kwargs)
    no_compiler = {"cpp.cxx": ("hf-blockdiff-no-such-compiler",)} if case == "compile_without_compiler" else {}
    with torch._inductor.config.patch(no_compiler):  # inductor finds no C++ compiler to build its CPU kernels with
        call_fails(model, kwargs.pop("input_ids"), kwargs.pop("config"), match, error, **kwargs)
    assert torch.equal(normal_call(model), normal_call(tiny_model("qwen3", seed=3)))


def test_compile_on_cuda_needs_triton(monkeypatch):
    from hf_blockdiff.generation import inputs

    monkeypatch.setattr(inputs, "TRITON_AVAILABLE", False)
    with pytest.raises(ValueError, match=r"compile=True is invalid: torch.compile needs Triton on CUDA"):
        inputs.check_call(CFG.replace(compile=True), torch.device("cuda"), None, None)
    inputs.check_call(CFG, torch.device("cuda"), None, None)  # compile=None compiles only where it can
