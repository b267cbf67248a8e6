"""Synthetic task of the demo model: short problems whose answers are checked exactly.

Three kinds of problem, each a prompt that ends with "=" and a short answer (the model writes the answer, then
`<eos>`):

    add   "57+38="        -> "95"        operands 0-99
    sort  "sort 53912="   -> "12359"     2-6 digits, ascending
    rev   "rev hello="    -> "olleh"     2-6 lowercase letters, reversed

Prompts are 4 to 12 characters and answers 1 to 6. The trailing "=" marks where the answer starts, which the model
cannot otherwise tell when the first answer characters are already unmasked (the prompt tail and the answer share
a block). The sizes are what a ~2M-parameter model learns to ~99 % on two CPU cores in minutes: 3-4 digit addition
(most significant digit first) or 8-item lists need several times more training.

Splits: a problem belongs to `held_out` when the hash of its prompt falls in a fixed tenth of the hash range,
else to `train`; the answer is a function of the prompt, so the splits never share a problem."""

from __future__ import annotations

import hashlib
import random
import string
import time
from collections.abc import Iterator
from dataclasses import dataclass

from transformers import PreTrainedTokenizerFast

from ..config import BlockDiffusionConfig

KINDS = ("add", "sort", "rev")
SPLITS = ("train", "held_out")
MAX_ADD_DIGITS = 2
MAX_LIST_LEN = 6
MAX_PROMPT_CHARS = len("sort ") + MAX_LIST_LEN + len("=")
MAX_ANSWER_CHARS = MAX_LIST_LEN

PAD, EOS, MASK, UNK = "<pad>", "<eos>", "<mask>", "<unk>"
SPECIAL_TOKENS = (PAD, EOS, MASK, UNK)  # ids 0..3, in this order
ALPHABET = " +=" + string.digits + string.ascii_lowercase


def answer_for(prompt: str) -> str:
    """The exact answer of a prompt made by `make_problems`."""
    body = prompt.removesuffix("=")
    if body.startswith("sort "):
        return "".join(sorted(body[len("sort "):]))
    if body.startswith("rev "):
        return body[len("rev "):][::-1]
    a, b = body.split("+")
    return str(int(a) + int(b))


def split_of(prompt: str) -> str:
    digest = hashlib.sha256(prompt.encode()).digest()
    return "held_out" if int.from_bytes(digest[:4], "big") % 10 == 0 else "train"


def _sample_prompt(rng: random.Random, kind: str) -> str:
    if kind == "add":
        return f"{rng.randrange(10**MAX_ADD_DIGITS)}+{rng.randrange(10**MAX_ADD_DIGITS)}="
    n = rng.randint(2, MAX_LIST_LEN)
    if kind == "sort":
        return "sort " + "".join(rng.choices(string.digits, k=n)) + "="
    return "rev " + "".join(rng.choices(string.ascii_lowercase, k=n)) + "="


def problem_stream(seed: int, split: str = "train", weights: tuple[float, ...] = (1, 1, 1)) -> Iterator[tuple[str, str]]:
    """Endless deterministic stream of (prompt, answer) pairs of one split; `weights` are those of `KINDS`."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    rng = random.Random(f"{split}-{seed}")
    while True:
        prompt = _sample_prompt(rng, rng.choices(KINDS, weights=weights)[0])
        if split_of(prompt) == split:
            yield prompt, answer_for(prompt)


def make_problems(n: int, seed: int, split: str = "train", weights: tuple[float, ...] = (1, 1, 1)) -> list[tuple[str, str]]:
    """`n` distinct (prompt, answer) pairs, the same for the same arguments (an evaluation set: the rare repeats of
    the stream, short lists mostly, are skipped)."""
    problems: dict[str, str] = {}
    stream = problem_stream(seed, split, weights)
    while len(problems) < n:
        problems.setdefault(*next(stream))
    return list(problems.items())


def is_correct(prompt: str, generated_text: str) -> bool:
    """Whether the text generated after `prompt` is its answer.

    The text is cut at the first `<eos>` (decode with special tokens kept, or cut the ids at the first eos id before
    decoding with `skip_special_tokens=True`); `<pad>` and surrounding spaces are ignored."""
    answer = generated_text.split(EOS, 1)[0].replace(PAD, "").strip()
    return answer == answer_for(prompt)


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Character-level tokenizer of the task alphabet: one token per character, special tokens first."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + tuple(ALPHABET))}
    backend = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token=PAD, eos_token=EOS, mask_token=MASK, unk_token=UNK, padding_side="left"
    )


@dataclass
class Solved:
    accuracy: float
    num_forwards: int
    tokens_per_forward: float
    tok_s: float
    outputs: list[str]


def solve(model, tokenizer, problems: list[tuple[str, str]], cfg: BlockDiffusionConfig) -> Solved:
    """Decode every problem's prompt in one batch; the text up to the first stop token is the answer."""
    prompts = [prompt for prompt, _ in problems]
    enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False).to(model.device)
    start = time.perf_counter()
    out = model.generate_multi_block(enc.input_ids, cfg, attention_mask=enc.attention_mask, return_dict=True)
    seconds = time.perf_counter() - start
    generated = out.sequences[:, enc.input_ids.shape[1]:]
    texts = [tokenizer.decode(row, skip_special_tokens=True) for row in generated]
    return Solved(
        accuracy=sum(is_correct(p, t) for p, t in zip(prompts, texts)) / len(prompts),
        num_forwards=out.num_forwards,
        tokens_per_forward=out.tokens_per_forward,
        tok_s=int((out.commit_step >= 0).sum()) / seconds,
        outputs=texts,
    )
