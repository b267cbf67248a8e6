"""What a new user hit: calls that never ended on inf/nan, silently wrong answers on unmasked padding, a preset
that contradicts the model, ids outside the vocabulary. Each now fails fast with an error naming the fix, or does
what transformers' `generate` does."""

import copy
import signal
from contextlib import contextmanager

import pytest
import torch

from hf_blockdiff import BlockDiffusionConfig
from hf_blockdiff.generation import inputs
from hf_blockdiff.generation.engine import _Progress
from hf_blockdiff.model_patches.sdar import SDARConfig, SDARForCausalLM

from helpers import MASK, VOCAB, left_pad, random_prompts, tiny_model

CFG = BlockDiffusionConfig(mask_token_id=MASK, block_size=4, max_new_tokens=8, attention="block_causal",
                           strategy="confidence_threshold", threshold=0.99, eos_token_id=[])


@contextmanager
def deadline(seconds: int):
    """Fail the test instead of hanging."""
    def expired(*_):
        raise TimeoutError(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@pytest.mark.parametrize("cuda_graphs", [False, True])
def test_nan_logits_end_the_call_naming_prompt_and_forward(cuda_graphs):
    model = tiny_model("qwen3", seed=5)
    with torch.no_grad():
        model.lm_head.weight[7, 0] = float("nan")  # every logits row holds a nan
    before = copy.deepcopy(model.state_dict())
    ids, mask = left_pad(random_prompts((5, 9), seed=1))
    with deadline(60), pytest.raises(FloatingPointError, match=r"prompt 0 .*inf or nan at forward 2"):
        model.generate_multi_block(ids, CFG.replace(cuda_graphs=cuda_graphs), attention_mask=mask)
    assert model.config._attn_implementation == "sdpa"
    assert all(torch.equal(before[k].nan_to_num(), v.nan_to_num()) for k, v in model.state_dict().items())


def test_unmasked_left_padding_is_inferred_like_transformers(qwen3):
    prompts = random_prompts((5, 9), seed=2)
    ids, mask = left_pad(prompts, pad=3)
    cfg = CFG.replace(pad_token_id=3, threshold=0.6)
    assert torch.equal(qwen3.generate_multi_block(ids, cfg), qwen3.generate_multi_block(ids, cfg, attention_mask=mask))


def test_unmasked_padding_with_a_stop_id_as_pad_warns(qwen3, monkeypatch):
    warned = []
    monkeypatch.setattr(inputs.logger, "warning_once", warned.append)
    ids, _ = left_pad(random_prompts((5, 9), seed=2), pad=3)
    qwen3.generate_multi_block(ids, CFG.replace(eos_token_id=[3], threshold=0.6))
    assert len(warned) == 1 and "attention_mask" in warned[0]


@pytest.mark.parametrize("mask", [[[1, 1, 1]], "ones"], ids=["list", "string"])
def test_attention_mask_must_be_a_tensor(qwen3, mask):
    with pytest.raises(ValueError, match="attention_mask is a (list|str): pass a torch.Tensor"):
        qwen3.generate_multi_block(torch.tensor([[1, 2, 3]]), CFG, attention_mask=mask)


@pytest.mark.parametrize("bad", [VOCAB, -1])
def test_input_ids_outside_the_vocabulary(qwen3, bad):
    with pytest.raises(ValueError, match=rf"input_ids\[0, 1\] = {bad} is outside the model's vocabulary \[0, {VOCAB}\)"):
        qwen3.generate_multi_block(torch.tensor([[1, bad, 3]]), CFG)


def test_mask_id_that_is_a_stop_id(qwen3):
    with pytest.raises(ValueError, match=rf"mask_token_id={MASK} .*also a stop id"):
        qwen3.generate_multi_block(torch.tensor([[1, 2, 3]]), CFG.replace(eos_token_id=[MASK]))


def sdar_model():
    torch.manual_seed(0)
    config = SDARConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                        num_attention_heads=2, num_key_value_heads=1, head_dim=16, block_size=4)
    return SDARForCausalLM(config).eval()


def test_profile_stop_ids_outside_the_vocabulary():
    """SDAR's family stop ids (151645, 151643) do not exist in a 96-token checkpoint."""
    with pytest.raises(ValueError, match=r"eos_token_id=.*151645.*vocabulary has 96 ids"):
        sdar_model().generate_multi_block(torch.tensor([[1, 2, 3]]), BlockDiffusionConfig(mask_token_id=MASK))


def test_preset_that_contradicts_the_profile():
    model = sdar_model()
    cfg = BlockDiffusionConfig.from_preset("d3llm", mask_token_id=MASK, eos_token_id=[], block_size=4)
    with pytest.raises(ValueError, match="Preset 'd3llm' decodes with alignment='prompt_end' but this model's "
                                         "profile has alignment='absolute'"):
        model.generate_multi_block(torch.tensor([[1, 2, 3]]), cfg)
    with pytest.warns(UserWarning, match="logit_shift=True overrides this model's logit_shift=False"):
        model.generate_multi_block(torch.tensor([[1, 2, 3]]), BlockDiffusionConfig(
            mask_token_id=MASK, eos_token_id=[], max_new_tokens=4, logit_shift=True))


def test_progress_counts_tokens_and_prompts():
    with _Progress(prompts=3, new_tokens=8) as progress:
        progress.show([], decided=[3, 5], owner=[0, 1])
        assert progress.bar.n == 8
        progress.show([0], decided=[9, 6], owner=[-1, 1])  # slot 0 finished (its tail past 8 does not count)
        assert progress.bar.n == 8 + 6 and progress.finished == 1


@pytest.mark.parametrize("pad", [1, 3, 6])
def test_repetition_penalty_reads_only_the_row_itself(qwen3, pad):
    """The penalty used to read the whole canvas row: the pad fill past a shorter prompt's end and the scratch
    column, so a prompt's tokens depended on the rest of the batch."""
    prompts = random_prompts((3, 11, 6), seed=9)
    cfg = CFG.replace(strategy="low_confidence_dynamic", threshold=0.6, pad_token_id=pad, repetition_penalty=3.0)
    ids, mask = left_pad(prompts)
    batch = qwen3.generate_multi_block(ids, cfg, attention_mask=mask)[:, ids.shape[1]:]
    for row, prompt in enumerate(prompts):
        assert torch.equal(batch[row], qwen3.generate_multi_block(prompt[None], cfg)[0, len(prompt):])
