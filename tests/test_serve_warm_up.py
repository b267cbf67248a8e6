"""`hf-blockdiff serve` warms up before it listens (serve/warm_up.py): one row decoded on the started engine, then the
heap frozen; a failing row stops the start, a row past its time is cancelled and the server listens."""

import gc

import pytest

pytest.importorskip("fastapi")

from hf_blockdiff.generation.live import LiveEngine, RowUpdate  # noqa: E402
from hf_blockdiff.serve.admission import Limits  # noqa: E402
from hf_blockdiff.serve.command import limits_of  # noqa: E402
from hf_blockdiff.serve.warm_up import warm_up  # noqa: E402

from serving import CFG, demo  # noqa: E402,F401  (a fixture)

LIMITS = Limits(max_prompt_tokens=16, max_new_tokens=8)


def test_warm_up_decodes_a_row_on_the_engine_then_freezes_the_heap(demo):  # noqa: F811
    model, tokenizer = demo
    limits = limits_of(model, CFG, True)
    engine = LiveEngine(model, CFG.replace(max_new_tokens=limits.max_new_tokens), max_batch_size=2,
                        max_prompt_tokens=limits.max_prompt_tokens, max_new_tokens=limits.max_new_tokens)
    engine.start()
    frozen = gc.get_freeze_count()
    try:
        warm_up(engine, limits)
        assert engine.forwards > 0 and gc.get_freeze_count() > frozen
    finally:
        gc.unfreeze()  # this is pytest's process: the later tests' garbage stays collectable
        engine.close()


class ScriptedEngine:
    """Answers a submitted row with `updates` (none: the row never ends); records cancels."""

    def __init__(self, *updates):
        self.updates, self.cancelled, self.rows = updates, False, []

    def submit(self, prompt, settings, on_update):
        self.rows.append((list(prompt), settings.max_new_tokens))
        for update in self.updates:
            on_update(update)
        return self

    def cancel(self):
        self.cancelled = True


def test_a_failing_warm_up_row_stops_the_start():
    engine = ScriptedEngine(RowUpdate([], [], 1, "error", error=ValueError("no kernel image")))
    with pytest.raises(RuntimeError, match="warm-up row failed.*no kernel image"):
        warm_up(engine, LIMITS)
    assert engine.rows == [([0] * 16, 8)]  # the server's shorter prompt limit, its most new tokens


def test_a_warm_up_row_past_its_time_is_cancelled_and_nothing_is_frozen():
    engine, frozen = ScriptedEngine(RowUpdate([5], [0.0], 1, None)), gc.get_freeze_count()
    warm_up(engine, LIMITS, timeout=0.05)
    assert engine.cancelled and gc.get_freeze_count() == frozen
