import dataclasses

import pytest
import torch
from transformers import AutoTokenizer

from hf_blockdiff.tools import tasks
from hf_blockdiff.tools.train_tiny import (
    PRESETS,
    STATE_FILE,
    TinyModelConfig,
    TrainConfig,
    add_noise,
    additive_mask,
    block_causal_mask,
    build_model,
    encode,
    fit,
    train,
    training_layout,
)

SMALL = TrainConfig(
    model=TinyModelConfig(hidden_size=64, num_layers=2, head_dim=16, intermediate_size=128),
    batch_size=32,
    warmup_steps=5,
)


def test_problems_are_deterministic_and_correct():
    assert tasks.make_problems(50, seed=3) == tasks.make_problems(50, seed=3)
    assert tasks.make_problems(50, seed=3) != tasks.make_problems(50, seed=4)
    for prompt, answer in tasks.make_problems(300, seed=0) + tasks.make_problems(300, seed=0, split="held_out"):
        assert prompt.endswith("=") and len(prompt) <= tasks.FAMILIES["demo"].max_prompt_chars
        assert 0 < len(answer) <= tasks.FAMILIES["demo"].max_answer_chars
        assert tasks.is_correct(prompt, answer + tasks.EOS + "xyz" + tasks.PAD)
        assert not tasks.is_correct(prompt, answer + "1")


def test_answers():
    assert tasks.answer_for("123+4567=") == "4690"
    assert tasks.answer_for("sort 53912=") == "12359"
    assert tasks.answer_for("rev hello=") == "olleh"
    assert tasks.is_correct("9+1=", "10<eos><pad><pad>")
    assert not tasks.is_correct("9+1=", "1<eos>0")


def test_held_out_never_overlaps_train():
    train = {p for p, _ in tasks.make_problems(5000, seed=0)}
    held_out = {p for p, _ in tasks.make_problems(1000, seed=0, split="held_out")}
    assert not train & held_out
    assert all(tasks.split_of(p) == "held_out" for p in held_out)


def test_tokenizer_round_trip(tmp_path):
    tokenizer = tasks.build_tokenizer()
    tokenizer.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert (loaded.pad_token_id, loaded.eos_token_id, loaded.mask_token_id) == (0, 1, 2)
    text = "sort 53912=12359<eos><pad>"
    ids = loaded(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len("sort 53912=12359") + 2 and ids[-2:] == [1, 0]
    assert loaded.decode(ids) == text
    assert loaded.decode(ids, skip_special_tokens=True) == "sort 53912=12359"
    assert loaded.unk_token_id not in loaded(tasks.ALPHABET, add_special_tokens=False)["input_ids"]


def test_masks():
    staircase = block_causal_mask(6, 2)
    assert staircase[2, 3] and not staircase[1, 2] and staircase[5, 0]
    # [x_t[2:6] | x_0[0:4]] with blocks of 2: noisy blocks 1, 2 then clean blocks 0, 1
    positions, mask = training_layout(6, 2, noisy_start=2)
    assert positions.tolist() == [2, 3, 4, 5, 0, 1, 2, 3]
    noisy_1, noisy_2, clean_0, clean_1 = 0, 2, 4, 6
    assert mask[noisy_1, noisy_1 + 1] and not mask[noisy_1, noisy_2] and not mask[noisy_2, noisy_1]
    assert mask[noisy_1, clean_0] and not mask[noisy_1, clean_1] and mask[noisy_2, clean_1]
    assert mask[clean_1, clean_0] and mask[clean_0, clean_0 + 1] and not mask[clean_0, clean_1]
    assert not mask[4:, :4].any()  # the clean part never sees the noisy one


def test_noise_never_masks_the_prompt():
    tokenizer = tasks.build_tokenizer()
    x0, answer_start = encode(tasks.make_problems(64, seed=0), tokenizer, 24)
    xt, masked = add_noise(x0, answer_start, 4, tokenizer.mask_token_id, torch.Generator().manual_seed(0))
    prompt = torch.arange(24)[None] < answer_start[:, None]
    assert not masked[prompt].any() and masked.any()
    assert torch.equal(xt == tokenizer.mask_token_id, masked)
    assert (x0 == tokenizer.eos_token_id).sum(1).eq(1).all()


def test_training_is_deterministic_and_learns():
    a, b = fit(SMALL, seed=0, steps=60, log=None), fit(SMALL, seed=0, steps=60, log=None)
    assert a.losses == b.losses
    for (name, weight_a), weight_b in zip(a.model.state_dict().items(), b.model.state_dict().values()):
        assert torch.equal(weight_a, weight_b), name
    assert sum(a.losses[-20:]) / 20 < 0.7 * sum(a.losses[:20]) / 20


def test_a_run_stopped_by_its_time_limit_resumes_bit_for_bit(tmp_path):
    """Weights, optimizer, schedule, noise and data order all come back: 3 parts of a run equal it in one go."""
    whole = fit(SMALL, seed=1, steps=12, log=None)
    state = tmp_path / "state.pt"
    parts = [fit(SMALL, seed=1, steps=12, log=None, state_path=state, max_seconds=limit) for limit in (0.0, 0.0, None)]
    assert [len(part.losses) for part in parts] == [1, 2, 12]  # a part takes one step at least
    assert parts[-1].losses == whole.losses
    for (name, a), b in zip(whole.model.state_dict().items(), parts[-1].model.state_dict().values()):
        assert torch.equal(a, b), name
    with pytest.raises(ValueError, match="holds a run with other arguments"):
        fit(SMALL, seed=2, steps=12, log=None, state_path=state)


def test_train_writes_the_checkpoint_only_when_the_run_is_done(tmp_path):
    config = dataclasses.replace(SMALL, eval_size=8)
    assert train(str(tmp_path), seed=0, steps=6, config=config, log=None, max_seconds=0.0) is None
    assert (tmp_path / STATE_FILE).exists() and not (tmp_path / "config.json").exists()
    metrics = train(str(tmp_path), seed=0, steps=6, config=config, log=None)
    assert metrics.steps == 6 and len(metrics.losses) == 6
    assert (tmp_path / "config.json").exists() and not (tmp_path / STATE_FILE).exists()


def test_hard_preset_is_a_5_to_30m_model_of_the_hard_family():
    preset = PRESETS["hard"]
    model = build_model(preset.model, tasks.build_tokenizer(preset.task))
    assert 5e6 <= sum(p.numel() for p in model.parameters()) <= 30e6
    longest = tasks.FAMILIES["hard"].max_prompt_chars + tasks.FAMILIES["hard"].max_answer_chars + 1
    assert longest <= preset.model.seq_len and preset.model.seq_len % preset.model.block_size == 0
    assert len(tasks.build_tokenizer("hard")) <= preset.model.vocab_size


def test_training_view_is_the_decoding_view():
    """Logits of a noisy block in the training forward equal those of a plain block-causal forward over the clean
    prefix and that block, which is what the decoder computes."""
    tokenizer = tasks.build_tokenizer()
    torch.manual_seed(0)
    model = build_model(SMALL.model, tokenizer).eval()
    length, block_size = SMALL.model.seq_len, SMALL.model.block_size
    x0, answer_start = encode(tasks.make_problems(16, seed=0), tokenizer, length)
    xt, _ = add_noise(x0, answer_start, block_size, tokenizer.mask_token_id, torch.Generator().manual_seed(0))
    noisy_start = int(answer_start.min()) // block_size * block_size
    positions, allowed = training_layout(length, block_size, noisy_start)
    with torch.no_grad():
        hidden = model.model(
            input_ids=torch.cat([xt[:, noisy_start:], x0[:, : length - block_size]], 1),
            attention_mask=additive_mask(allowed),
            position_ids=positions[None],
        ).last_hidden_state
        training_logits = model.lm_head(hidden[:, : length - noisy_start])
        for start in range(noisy_start, length, block_size):
            canvas = torch.cat([x0[:, :start], xt[:, start : start + block_size]], 1)
            logits = model(
                input_ids=canvas,
                attention_mask=additive_mask(block_causal_mask(canvas.shape[1], block_size)),
                position_ids=torch.arange(canvas.shape[1])[None],
            ).logits
            expected = training_logits[:, start - noisy_start : start - noisy_start + block_size]
            torch.testing.assert_close(logits[:, start:], expected, rtol=1e-4, atol=1e-4)
