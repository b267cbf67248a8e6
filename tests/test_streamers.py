"""transformers streamers get the committed text in order; `put_draft` streamers also see every step's canvas."""

import threading

import pytest
import torch
from transformers import TextIteratorStreamer, TextStreamer

from hf_blockdiff import BlockDiffusionConfig

from helpers import MASK, char_tokenizer, tiny_model

# a threshold below most confidences commits several tokens per step, in any order inside a block
CFG = BlockDiffusionConfig(mask_token_id=MASK, block_size=4, max_new_tokens=16, attention="block_causal",
                           threshold=0.3, eos_token_id=[])


@pytest.fixture(scope="module")
def setup():
    tokenizer = char_tokenizer()
    ids = torch.tensor([tokenizer("Once upon a").input_ids])
    model = tiny_model("qwen3", seed=1)  # its output holds newlines, where TextStreamer flushes
    out = model.generate_multi_block(ids, CFG)
    return model, tokenizer, ids, tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


class RecordingStreamer(TextStreamer):
    def __init__(self, tokenizer):
        super().__init__(tokenizer, skip_prompt=True, skip_special_tokens=True)
        self.text = ""
        self.texts = []

    def on_finalized_text(self, text: str, stream_end: bool = False):
        self.text += text
        self.texts.append(self.text)


def test_text_streamer_receives_the_output_in_order(setup):
    model, tokenizer, ids, expected = setup
    streamer = RecordingStreamer(tokenizer)
    model.generate_multi_block(ids, CFG, streamer=streamer)
    assert streamer.text == expected
    assert all(expected.startswith(text) for text in streamer.texts)  # a row's text never goes backwards


def test_text_iterator_streamer(setup):
    model, tokenizer, ids, expected = setup
    streamer = TextIteratorStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True, timeout=60)
    thread = threading.Thread(target=model.generate_multi_block, args=(ids, CFG), kwargs={"streamer": streamer})
    thread.start()
    received = ""
    for chunk in streamer:
        received += chunk
        assert expected.startswith(received)
    thread.join()
    assert received == expected


class DraftStreamer:
    def __init__(self):
        self.committed, self.drafts = [], []

    def put(self, tokens):
        self.committed.append(tokens.tolist())

    def put_draft(self, tokens, decided):
        self.drafts.append((tokens.clone(), decided.clone()))

    def end(self):
        pass


def test_put_draft_sees_every_step(setup):
    model, _, ids, _ = setup
    streamer = DraftStreamer()
    out = model.generate_multi_block(ids, CFG, streamer=streamer, return_dict=True)
    generated = out.sequences[0, ids.shape[1]:]
    assert len(streamer.drafts) == out.num_forwards - 1  # one per step; the prefill is no step
    previous = torch.zeros(CFG.max_new_tokens, dtype=torch.bool)
    for tokens, decided in streamer.drafts:
        assert torch.equal(decided, tokens != MASK)
        assert torch.equal(tokens[decided], generated[decided])  # decided tokens are final
        assert bool((decided | ~previous).all())  # never undecided again
        previous = decided
    assert bool(previous.all())
    assert sum(streamer.committed[1:], []) == generated.tolist()  # after the prompt: the tokens, once, in order
    assert any(0 < int(d.sum()) < CFG.max_new_tokens and not bool(d[: int(d.sum())].all())
               for _, d in streamer.drafts)  # some step decided a position ahead of an undecided one
