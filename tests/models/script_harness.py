"""What the released-script tests share: a tiny checkpoint of a family, and a proxy through which a re-implemented
released script calls the model.

The proxy forwards each call, unchanged, to the model and checks the logits it returns against the plain-torch
reference (`torch_reference.py`, fp32, 1e-5) computed on the whole sequence the call stands for: the call names that
`canvas` and the `span` of positions whose logits it returns; `fresh` marks the positions whose keys and values the
call computes anew, the others coming from the canvas of the last call made with `record=True` (a cache filled by
that call). With `substitute=True` the script then reads the reference logits instead of the model's, so running a
script both ways compares its tokens under the released call forms with its tokens under the reference.
"""

from __future__ import annotations

import torch
from released_checkpoints import random_state, write_checkpoint
from transformers import AutoModelForCausalLM

MASK = 95  # the mask id of the tiny family configs


def load_family(tmp_path, config, auto_class=AutoModelForCausalLM):
    """(model, released weights) of a tiny fp32 checkpoint in the family's released format."""
    state = random_state(config)
    model = auto_class.from_pretrained(write_checkpoint(tmp_path / config["model_type"], config, state),
                                       dtype=torch.float32)
    return model.eval(), state


class CheckedModel:
    def __init__(self, model, reference, substitute=False):
        """`reference(canvas, stale, record)`: the reference logits of the whole canvas [batch, length, vocab]."""
        self.model, self.reference, self.substitute = model, reference, substitute
        self.recorded, self.forms = None, []

    def __getattr__(self, name):  # what else the script reads on the model (its device, helpers)
        return getattr(self.model, name)

    def __call__(self, *args, canvas, span, fresh=None, record=False, **kwargs):
        output = self.model(*args, **kwargs)
        recording = [] if record else None
        stale = None if fresh is None else (self.recorded, self._marked(fresh, canvas.shape[1]))
        expected = self.reference(canvas, stale, recording)[:, span]
        if record:
            self.recorded = recording
        torch.testing.assert_close(output.logits, expected, atol=1e-5, rtol=1e-5)
        self.forms.append(set(kwargs))
        if self.substitute:
            output["logits"] = expected
        return output

    @staticmethod
    def _marked(positions: slice, length: int) -> torch.Tensor:
        marked = torch.zeros(length, dtype=torch.bool)
        marked[positions] = True
        return marked


def both_ways(script, model, reference, *args, **kwargs):
    """Run `script(checked_model, ...)` with the model's logits and with the reference's; both results, and the
    keywords of each call (of the last run)."""
    runs = []
    for substitute in (False, True):
        checked = CheckedModel(model, reference, substitute)
        with torch.no_grad():
            runs.append(script(checked, *args, **kwargs))
    return runs[0], runs[1], checked.forms


def check_fast_dllm_block_script(script, model, logits, state, config, seed: int, dual_cache: bool) -> None:
    """A Fast-dLLM v1 block script (prefix or dual cache, threshold 0.3, blocks of 4, 12 new tokens) on `model` and on
    the full-recompute `logits` reference give the same tokens, and the script used the cache forms it names."""
    def reference(canvas, stale, record):
        everything = torch.ones(1, canvas.shape[1], canvas.shape[1], dtype=torch.bool)
        return logits(state, config, canvas, everything, stale=stale, record=record)

    prompt = torch.randint(0, 90, (1, 5), generator=torch.Generator().manual_seed(seed))
    tokens, reference_tokens, forms = both_ways(script, model, reference, prompt, 12, 4, 0.3, dual_cache)
    assert torch.equal(tokens, reference_tokens) and (tokens != MASK).all()
    cached = [form for form in forms if "past_key_values" in form]
    assert len(cached) > 3 and all(("replace_position" in form) == dual_cache for form in cached)


def confident_tokens(logits, masked, threshold):
    """Greedy proposals and which to take (`take_confident`)."""
    confidence, proposal = logits.softmax(-1).max(-1)
    return proposal, take_confident(confidence, masked, threshold)


def take_confident(confidence, masked, threshold):
    """Every masked position whose proposal's probability beats `threshold`, and the most confident masked one of each
    row (the Fast-dLLM scripts' rule)."""
    confidence = torch.where(masked, confidence, -torch.inf)
    chosen = confidence > threshold
    chosen[torch.arange(len(chosen)), confidence.argmax(-1)] = True
    return chosen & masked


def shift_logits(logits):
    """Dream's and Fast-dLLM v2's logit shift inside one call's logits: position i reads the logits of i - 1."""
    return torch.cat([logits[:, :1], logits[:, :-1]], dim=1)
