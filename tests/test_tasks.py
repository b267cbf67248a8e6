"""The synthetic task families of the demo models: the hard family's answers by hand, its limits, splits, length mix
and tokenizer; the demo family's stream is what it was (the bundled model was trained and measured on it)."""

import itertools

import pytest

from hf_blockdiff.tools import tasks

HARD = tasks.FAMILIES["hard"]


@pytest.mark.parametrize("prompt, answer", [
    ("48213+907=", "49120"),  # carries run against the writing direction
    ("99999+1=", "100000"),
    ("4821*37=", "178377"),
    ("sort 5391205518=", "0112355589"),
    ("uniq 53912055183=", "0123589"),
    ("cumsum 53912=", "58780"),  # 5, 5+3, 8+9 = 17, 7+1, 8+2 = 10 (mod 10)
    ("close ([{(=", ")}])"),
    ("shuffle 53912=", "12359"),  # of many right answers, the digits ascending
])
def test_hard_answers(prompt, answer):
    assert tasks.answer_for(prompt) == answer


def test_a_shuffle_takes_any_arrangement_and_training_shows_random_ones():
    assert tasks.is_correct("shuffle 53912=", "21935" + tasks.EOS) and tasks.is_correct("shuffle 53912=", "12359")
    assert not tasks.is_correct("shuffle 53912=", "21933") and not tasks.is_correct("shuffle 53912=", "2193")
    shown = [a for p, a in itertools.islice(tasks.problem_stream(0, task="hard"), 3000) if p.startswith("shuffle ")]
    assert sum(a != "".join(sorted(a)) for a in shown) > 0.8 * len(shown)  # not the sorted answer: a random order


def test_hard_problems_are_deterministic_within_limits_and_mixed():
    train = tasks.make_problems(2000, seed=0, task="hard")
    held_out = tasks.make_problems(400, seed=0, split="held_out", task="hard")
    assert train == tasks.make_problems(2000, seed=0, task="hard")
    assert not {p for p, _ in train} & {p for p, _ in held_out}
    assert all(tasks.split_of(p) == "held_out" for p, _ in held_out)
    lengths = []
    for prompt, answer in train + held_out:
        assert prompt.endswith("=") and len(prompt) <= HARD.max_prompt_chars
        assert 0 < len(answer) <= HARD.max_answer_chars and set(prompt + answer) <= set(HARD.alphabet)
        assert tasks.is_correct(prompt, answer + tasks.EOS + tasks.PAD)
        lengths.append(len(answer))
    assert sum(n >= 4 for n in lengths) >= 0.9 * len(lengths)  # blocks of 4 and of 8 both matter
    assert {n // 8 for n in lengths} == {0, 1, 2, 3, 4}  # answers of every length up to 36
    kinds = {"+": 0, "*": 0, "sort": 0, "uniq": 0, "cumsum": 0, "close": 0, "shuffle": 0}
    for prompt, _ in train:
        kinds[next(k for k in kinds if k in prompt)] += 1
    assert min(kinds.values()) > 0.1 * len(train)


def test_hard_tokenizer_extends_the_demo_ids():
    demo, hard = tasks.build_tokenizer(), tasks.build_tokenizer("hard")
    assert all(hard.convert_tokens_to_ids(t) == i for t, i in demo.get_vocab().items())
    ids = hard(HARD.alphabet, add_special_tokens=False)["input_ids"]
    assert hard.unk_token_id not in ids and len(ids) == len(HARD.alphabet)


def test_task_errors():
    with pytest.raises(ValueError, match="Unknown task family 'harder': choose one of demo, hard"):
        tasks.make_problems(1, seed=0, task="harder")
    with pytest.raises(ValueError, match=r"one weight per kind of the 'hard' family \(long_add, mul"):
        tasks.make_problems(1, seed=0, weights=(1, 1, 1), task="hard")
