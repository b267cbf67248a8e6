"""Synthetic tasks of the demo models: problems whose answers are checked exactly, in two families.

Each problem is a prompt that ends with "=" and an answer (the model writes the answer, then `<eos>`). The trailing
"=" marks where the answer starts, which the model cannot otherwise tell when the first answer characters are
already unmasked (the prompt tail and the answer share a block).

`demo` (the bundled CPU model; a ~2M-parameter model learns it to ~99 % on two CPU cores in minutes):

    add        "57+38="              -> "95"            operands 0-99
    sort       "sort 53912="         -> "12359"         2-6 digits, ascending
    rev        "rev hello="          -> "olleh"         2-6 lowercase letters, reversed

`hard` (answers of 1 to 36 tokens, most 4 or more, whose characters depend on each other, so decoding several at
once can go wrong: carries run against the writing direction, a running sum depends on everything before it, and a
shuffle has many right answers, so digits chosen apart from each other can repeat one and drop another):

    long_add   "48213+907="          -> "49120"         operands of 2-8 digits
    mul        "4821*37="            -> "178377"        2-4 digits times 1-2 digits
    long_sort  "sort 5391205518="    -> "0112355589"    10-36 digits
    uniq       "uniq 53912055183="   -> "0123589"       8-30 digits, their distinct digits ascending
    cumsum     "cumsum 53912="       -> "58780"         4-24 digits, each output digit the running sum mod 10
    close      "close ([{(="         -> ")}])"          4-20 opening brackets, the sequence that closes them
    shuffle    "shuffle 53912="      -> "21935"         4-12 digits in any order: every arrangement is right;
                                                        training shows a uniformly random one, `answer_for` the
                                                        ascending one

Splits: a problem belongs to `held_out` when the hash of its prompt falls in a fixed tenth of the hash range,
else to `train`; the answer is a function of the prompt, so the splits never share a problem."""

from __future__ import annotations

import hashlib
import random
import string
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from transformers import PreTrainedTokenizerFast

from ..config import BlockDiffusionConfig
from ..generation.hf_conventions import as_given

SPLITS = ("train", "held_out")
PAD, EOS, MASK, UNK = "<pad>", "<eos>", "<mask>", "<unk>"
SPECIAL_TOKENS = (PAD, EOS, MASK, UNK)  # ids 0..3, in this order
ALPHABET = " +=" + string.digits + string.ascii_lowercase  # the demo family's; the hard one appends its own
OPENING, CLOSING = "([{", ")]}"


def _digits(rng: random.Random, low: int, high: int) -> str:
    return "".join(rng.choices(string.digits, k=rng.randint(low, high)))


def _number(rng: random.Random, low: int, high: int) -> int:
    return int(_digits(rng, low, high))


SAMPLERS: dict[str, Callable[[random.Random], str]] = {
    "add": lambda rng: f"{rng.randrange(100)}+{rng.randrange(100)}=",
    "sort": lambda rng: f"sort {_digits(rng, 2, 6)}=",
    "rev": lambda rng: "rev " + "".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 6))) + "=",
    "long_add": lambda rng: f"{_number(rng, 2, 8)}+{_number(rng, 2, 8)}=",
    "mul": lambda rng: f"{_number(rng, 2, 4)}*{_number(rng, 1, 2)}=",
    "long_sort": lambda rng: f"sort {_digits(rng, 10, 36)}=",
    "uniq": lambda rng: f"uniq {_digits(rng, 8, 30)}=",
    "cumsum": lambda rng: f"cumsum {_digits(rng, 4, 24)}=",
    "close": lambda rng: "close " + "".join(rng.choices(OPENING, k=rng.randint(4, 20))) + "=",
    "shuffle": lambda rng: f"shuffle {_digits(rng, 4, 12)}=",
}
SHUFFLE = "shuffle "  # the one kind with many right answers


@dataclass(frozen=True)
class TaskFamily:
    kinds: tuple[str, ...]
    alphabet: str  # every character of its prompts and answers
    max_prompt_chars: int
    max_answer_chars: int


FAMILIES = {
    "demo": TaskFamily(("add", "sort", "rev"), ALPHABET, len("sort ") + 6 + len("="), 6),
    "hard": TaskFamily(("long_add", "mul", "long_sort", "uniq", "cumsum", "close", "shuffle"),
                       ALPHABET + "*" + OPENING + CLOSING, len("sort ") + 36 + len("="), 36),
}


def family(name: str) -> TaskFamily:
    if name not in FAMILIES:
        raise ValueError(f"Unknown task family {name!r}: choose one of {', '.join(FAMILIES)}.")
    return FAMILIES[name]


def _running_sums(digits: str) -> str:
    total, out = 0, []
    for digit in digits:
        total = (total + int(digit)) % 10
        out.append(str(total))
    return "".join(out)


RULES: dict[str, Callable[[str], str]] = {  # prompt prefix -> answer of the rest
    "sort ": lambda body: "".join(sorted(body)),
    SHUFFLE: lambda body: "".join(sorted(body)),
    "rev ": lambda body: body[::-1],
    "uniq ": lambda body: "".join(sorted(set(body))),
    "cumsum ": _running_sums,
    "close ": lambda body: "".join(CLOSING[OPENING.index(c)] for c in reversed(body)),
}


def answer_for(prompt: str) -> str:
    """The answer of a prompt made by `make_problems` (any family; of a shuffle's many, the digits ascending)."""
    body = prompt.removesuffix("=")
    for prefix, rule in RULES.items():
        if body.startswith(prefix):
            return rule(body[len(prefix):])
    if "*" in body:
        a, b = body.split("*")
        return str(int(a) * int(b))
    a, b = body.split("+")
    return str(int(a) + int(b))


def training_answer(prompt: str, rng: random.Random) -> str:
    """The answer training shows: `answer_for`, except that a shuffle's digits come in an order drawn from `rng`."""
    if not prompt.startswith(SHUFFLE):
        return answer_for(prompt)
    digits = list(prompt.removeprefix(SHUFFLE).removesuffix("="))
    rng.shuffle(digits)
    return "".join(digits)


def answers(prompt: str, answer: str) -> bool:
    """Whether `answer` is a right answer of `prompt`: the answer, or for a shuffle any arrangement of its digits."""
    if prompt.startswith(SHUFFLE):
        return sorted(answer) == sorted(prompt.removeprefix(SHUFFLE).removesuffix("="))
    return answer == answer_for(prompt)


def split_of(prompt: str) -> str:
    digest = hashlib.sha256(prompt.encode()).digest()
    return "held_out" if int.from_bytes(digest[:4], "big") % 10 == 0 else "train"


def problem_stream(seed: int, split: str = "train", weights: tuple[float, ...] | None = None,
                   task: str = "demo") -> Iterator[tuple[str, str]]:
    """Endless deterministic stream of (prompt, answer) pairs of one split of family `task`; `weights` are those of
    its kinds (None: equal)."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    kinds = family(task).kinds
    weights = weights or (1,) * len(kinds)
    if len(weights) != len(kinds):
        raise ValueError(f"weights={weights}: give one weight per kind of the {task!r} family ({', '.join(kinds)})")
    rng = random.Random(f"{split}-{seed}")
    while True:
        prompt = SAMPLERS[rng.choices(kinds, weights=weights)[0]](rng)
        if split_of(prompt) == split:
            yield prompt, training_answer(prompt, rng)


def make_problems(n: int, seed: int, split: str = "train", weights: tuple[float, ...] | None = None,
                  task: str = "demo") -> list[tuple[str, str]]:
    """`n` distinct (prompt, answer) pairs, the same for the same arguments (an evaluation set: the rare repeats of
    the stream, short lists mostly, are skipped; the answer is `answer_for`'s, one of a shuffle's many)."""
    problems: dict[str, str] = {}
    stream = problem_stream(seed, split, weights, task)
    while len(problems) < n:
        prompt, _ = next(stream)
        problems.setdefault(prompt, answer_for(prompt))
    return list(problems.items())


def is_correct(prompt: str, generated_text: str) -> bool:
    """Whether the text generated after `prompt` is a right answer (`answers`).

    The text is cut at the first `<eos>` (decode with special tokens kept, or cut the ids at the first eos id before
    decoding with `skip_special_tokens=True`); `<pad>` and surrounding spaces are ignored."""
    return answers(prompt, generated_text.split(EOS, 1)[0].replace(PAD, "").strip())


def build_tokenizer(task: str = "demo") -> PreTrainedTokenizerFast:
    """Character-level tokenizer of a family's alphabet: one token per character, special tokens first (the hard
    family's ids extend the demo family's)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + tuple(family(task).alphabet))}
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


def solve(model, tokenizer, problems: list[tuple[str, str]], cfg: BlockDiffusionConfig, samples: int = 1,
          generator: torch.Generator | None = None) -> Solved:
    """Decode every problem's prompt in one batch, `samples` times (rows prompt-major, `generator` seeds the
    sampling); the text up to the first stop token is the answer, the accuracy that of all rows."""
    prompts = [prompt for prompt, _ in problems]
    enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False).to(model.device)
    start = time.perf_counter()
    # as_given: the model's generation_config decides nothing, the reports hold what cfg says
    out = model.generate_multi_block(enc.input_ids, as_given(cfg), attention_mask=enc.attention_mask,
                                     return_dict=True, generator=generator, num_return_sequences=samples)
    seconds = time.perf_counter() - start
    generated = out.sequences[:, enc.input_ids.shape[1]:]
    texts = [tokenizer.decode(row, skip_special_tokens=True) for row in generated]
    rows = [prompt for prompt in prompts for _ in range(samples)]
    return Solved(
        accuracy=sum(is_correct(p, t) for p, t in zip(rows, texts)) / len(rows),
        num_forwards=out.num_forwards,
        tokens_per_forward=out.tokens_per_forward,
        tok_s=int((out.commit_step >= 0).sum()) / seconds,
        outputs=texts,
    )
