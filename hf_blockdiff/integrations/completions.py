"""Prompts in, completions out: tokenizing, left-padding, batching and decoding around `generate_multi_block`.

Shared by the CLI, the Trainer callback, lm-eval and the data-parallel helper. A prompt is a string (needs a
tokenizer), a list of token ids, or a list of chat messages (`chat=True`: formatted with the tokenizer's chat
template; with `chat=True` a string is one user message).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ..config import BlockDiffusionConfig


@dataclass
class Completion:
    token_ids: list[int]  # generated ids, up to and including the first stop token
    text: str | None  # token_ids decoded without special tokens (None without a tokenizer)
    num_forwards: int  # forwards of the batch that generated it
    steps: int  # decoding steps of this prompt (`BlockDiffusionOutput.steps`)


@dataclass
class Completions:
    """Completions in prompt order, with what their generation cost.

    `committed` counts the tokens the decoding steps committed as `BlockDiffusionOutput.tokens_per_forward` counts
    them (the rest of a stop token's block included), so `tokens_per_forward` has the output's meaning over all the
    batches: tokens committed per decoding step of a prompt, however the prompts were batched."""

    items: list[Completion] = field(default_factory=list)
    num_forwards: int = 0
    seconds: float = 0.0
    committed: int = 0

    @classmethod
    def joined(cls, parts: list["Completions"]) -> "Completions":
        """Parts generated side by side (one per process), in order."""
        return cls([c for part in parts for c in part.items], sum(p.num_forwards for p in parts),
                   max((p.seconds for p in parts), default=0.0), sum(p.committed for p in parts))

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.items)

    @property
    def tokens_per_forward(self) -> float:
        return self.committed / max(sum(c.steps for c in self.items), 1)

    @property
    def tokens_per_second(self) -> float:
        return self.num_tokens / self.seconds if self.seconds > 0 else 0.0

    def __len__(self) -> int:
        return len(self.items)

    def __iter__(self):
        return iter(self.items)

    def __getitem__(self, index: int) -> Completion:
        return self.items[index]


def encode(prompt, tokenizer=None, chat: bool = False) -> list[int]:
    """Token ids of one prompt."""
    if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(t, int) for t in prompt):
        return list(prompt)
    is_messages = isinstance(prompt, list) and bool(prompt) and all(isinstance(m, dict) for m in prompt)
    if not (isinstance(prompt, str) or is_messages):
        raise TypeError(f"A prompt is a string, a non-empty list of token ids or chat messages; got {prompt!r}.")
    if tokenizer is None:
        raise ValueError("Text and chat prompts need a tokenizer (pass tokenizer=...), or pass token-id lists.")
    if not chat:
        if is_messages:
            raise ValueError("Chat-message prompts need chat=True (--chat).")
        return tokenizer(prompt).input_ids
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False).input_ids


def left_padded(rows: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row) :] = torch.tensor(row, dtype=torch.long)
        mask[i, width - len(row) :] = 1
    return ids.to(device), mask.to(device)


def complete(model, prompts: list, config: BlockDiffusionConfig | None = None, tokenizer=None, *, batch_size: int = 16,
             chat: bool = False, progress: bool = False) -> Completions:
    """Generate for `prompts` in batches of `batch_size`, in order; `progress` shows a bar over several batches."""
    from tqdm.auto import tqdm

    encoded = [encode(p, tokenizer, chat) for p in prompts]
    pad_id = getattr(tokenizer, "pad_token_id", None) or 0
    result = Completions()
    starts = range(0, len(encoded), batch_size)
    for start in tqdm(starts, disable=not progress or len(starts) < 2, desc="generate"):
        began = time.perf_counter()
        ids, mask = left_padded(encoded[start : start + batch_size], pad_id, model.device)
        out = model.generate_multi_block(ids, config, attention_mask=mask, return_dict=True)
        generated = out.sequences[:, ids.shape[1] :].tolist()
        kept = (out.commit_step >= 0).sum(-1).tolist()  # a prefix: positions after the first stop token are dropped
        steps = out.steps.tolist()
        for tokens, length, row_steps in zip(generated, kept, steps):
            text = tokenizer.decode(tokens[:length], skip_special_tokens=True) if tokenizer is not None else None
            result.items.append(Completion(tokens[:length], text, out.num_forwards, row_steps))
        result.num_forwards += out.num_forwards
        result.committed += round(out.tokens_per_forward * max(sum(steps), 1))  # the output's TPF is committed/steps
        result.seconds += time.perf_counter() - began
    return result
