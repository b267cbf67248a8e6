"""Request limits: `max_forwards` ends a prompt after that many decoding steps, `max_repeat_run` once its tokens hold
a run of that many equal tokens; the rest of its output is the pad id, the other prompts of the batch are unaffected.
The expected outputs come from the unlimited decode: its `commit_step` says what a capped prompt had decided, and
its tokens where the first run ends (tokens never change once decided)."""

import pytest
import torch

from hf_blockdiff import BlockDiffusionConfig
from helpers import MASK, left_pad, random_prompts, tiny_model

PAD, NEW = 0, 16
LENGTHS = (8, 5, 11, 13)
SETTINGS = dict(mask_token_id=MASK, block_size=4, max_new_tokens=NEW, attention="block_causal", eos_token_id=[],
                threshold=0.6, pad_token_id=PAD)


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen3", seed=3)


def decode(model, prompts, **limits):
    ids, mask = left_pad(prompts)
    out = model.generate_multi_block(ids, BlockDiffusionConfig(**SETTINGS, **limits), attention_mask=mask,
                                     return_dict=True)
    return out.sequences[:, ids.shape[1]:], out


@pytest.mark.parametrize("graphs", [False, True])
def test_max_forwards_keeps_what_the_first_steps_decided(model, graphs):
    prompts = random_prompts(LENGTHS, seed=5)
    free, out = decode(model, prompts)
    cap = 3
    capped, capped_out = decode(model, prompts, max_forwards=cap, cuda_graphs=graphs)
    for row, prompt in enumerate(prompts):
        prefill = int(len(prompt) >= 4)  # the forward before the first step
        kept = (out.commit_step[row] >= 1) & (out.commit_step[row] <= cap + prefill)
        assert capped[row].tolist() == torch.where(kept, free[row], PAD).tolist()
    assert capped_out.steps.tolist() == [min(cap, int(s)) for s in out.steps]
    assert (capped == PAD).any() and capped_out.num_forwards < out.num_forwards


def test_a_limit_that_does_not_bind_changes_nothing(model):
    prompts = random_prompts(LENGTHS, seed=5)
    free, _ = decode(model, prompts)
    assert torch.equal(decode(model, prompts, max_forwards=1000, max_repeat_run=NEW + 1)[0], free)


def _first_run_end(tokens: list[int], run: int) -> int | None:
    for start in range(len(tokens) - run + 1):
        if len(set(tokens[start:start + run])) == 1:
            return start + run - 1
    return None


@pytest.mark.parametrize("graphs", [False, True])
def test_max_repeat_run_ends_the_output_with_the_run(model, graphs):
    prompts = random_prompts(LENGTHS, seed=6)
    free, _ = decode(model, prompts)
    run = 4
    cut, _ = decode(model, prompts, max_repeat_run=run, cuda_graphs=graphs)
    ends = [_first_run_end(row.tolist(), run) for row in free]
    assert any(end is not None for end in ends) and any(end is None for end in ends)  # both cases are exercised
    for row, end in enumerate(ends):
        expected = free[row].tolist() if end is None else free[row, :end + 1].tolist() + [PAD] * (NEW - end - 1)
        assert cut[row].tolist() == expected


def test_a_streamer_stops_at_the_run(model):
    class Chunks:
        def __init__(self):
            self.tokens = []

        def put(self, value):
            self.tokens.append(value.flatten())

        def end(self):
            pass

    prompts = random_prompts(LENGTHS, seed=6)
    free, _ = decode(model, prompts)
    ends = {i: _first_run_end(tokens.tolist(), 4) for i, tokens in enumerate(free)}
    row = min((i for i in ends if ends[i] is not None), key=ends.get)  # the earliest run
    streamer = Chunks()
    ids = prompts[row][None]
    out = model.generate_multi_block(ids, BlockDiffusionConfig(**SETTINGS, max_repeat_run=4), streamer=streamer)
    streamed = torch.cat(streamer.tokens)[ids.shape[1]:]
    end = _first_run_end(free[row].tolist(), 4)
    assert end < NEW - 1  # the run ends before the output does: tokens after it were not streamed
    assert streamed.tolist() == out[0, ids.shape[1]:end + ids.shape[1] + 1].tolist()


@pytest.mark.parametrize("settings, name", [
    (dict(max_forwards=0), "max_forwards"),
    (dict(max_forwards=2.5), "max_forwards"),
    (dict(max_forwards=True), "max_forwards"),
    (dict(max_repeat_run=1), "max_repeat_run"),
    (dict(max_repeat_run=3, eos_fill=True), "max_repeat_run"),
])
def test_bad_limits(settings, name):
    with pytest.raises(ValueError, match=name):
        BlockDiffusionConfig(**SETTINGS, **settings)
