"""The scheduler without any model: window policies, decisions and stopping on scores made up by the test."""

import pytest
import torch

from hf_blockdiff import BlockDiffusionConfig
from hf_blockdiff.scheduler import Scheduler, geometry, window_policy
from hf_blockdiff.scheduler.settings import SlotSettings
from hf_blockdiff.scheduler.windows import (BlockCausal, DualCache, Editing, FullRecompute, MultiBlock,
                                            PrefixCache, StoreForward, SubBlocks)
from hf_blockdiff.strategies.scoring import Scores

MASK, STOP = 99, 7
BASE = dict(mask_token_id=MASK, block_size=4, max_new_tokens=8, attention="block_causal", alignment="absolute",
            logit_shift=False, steps_per_block=4, pad_token_id=0, eos_token_id=[])


def config(**changes) -> BlockDiffusionConfig:
    return BlockDiffusionConfig(**{**BASE, **changes})


def token_at(position: torch.Tensor) -> torch.Tensor:
    return 10 + position % 5  # never MASK or STOP


def made_up_scores(request, confidence=lambda positions: 0.5 + 0.01 * positions.float(), token=token_at) -> Scores:
    positions = request.positions
    c = confidence(positions)
    return Scores(token(positions), c, 1 - c, c, c.log())


def decode(cfg, prompts, scores=made_up_scores, max_steps=100):
    """Drive the scheduler as the executor would (no prefill: nothing is cached); returns it and the forward log:
    per forward, each slot's span and how many positions it committed."""
    lengths = torch.tensor([len(p) for p in prompts])
    _, row_end, num_blocks = geometry(lengths, cfg)
    scheduler = Scheduler(cfg, len(prompts), int(row_end.max()), int(num_blocks.max()), torch.device("cpu"))
    state = scheduler.state
    scheduler.start_call()
    slots = torch.arange(len(prompts))
    scheduler.admit(slots, prompts, torch.arange(len(prompts)), [SlotSettings.of(cfg)] * len(prompts))
    scheduler.prepare(torch.ones(len(prompts), dtype=torch.bool))
    log = []
    for _ in range(max_steps):
        if bool(state.done.all()):
            return scheduler, log
        status = state.status()
        layout = scheduler.forward_layout(None)
        scheduler.stored(layout.chunks)
        request = scheduler.score_request(status, None)
        decision = scheduler.decide(request, status, scores(request))
        log.append((layout.chunks.start.tolist(), layout.chunks.end.tolist(), decision.commit.sum((1, 2)).tolist()))
        scheduler.apply(decision)
        scheduler.end_step()
    raise AssertionError("the scheduler did not finish")


def generated(scheduler, row, length):
    state = scheduler.state
    start = int(state.prompt_len[row])
    return state.canvas[row, start:start + length]


@pytest.mark.parametrize("changes,policy", [
    (dict(), BlockCausal), (dict(max_active_blocks=2), MultiBlock), (dict(fused_store=False), StoreForward),
    (dict(fused_store=False, sub_block_size=2), SubBlocks), (dict(attention="bidirectional"), FullRecompute),
    (dict(attention="bidirectional", approx_cache="prefix"), PrefixCache),
    (dict(attention="bidirectional", approx_cache="dual"), DualCache), (dict(editing_threshold=0.5), Editing),
])
def test_one_policy_per_mode(changes, policy):
    assert type(window_policy(config(**changes))) is policy


def test_sequential_fused_store_windows():
    """One token per step, leftmost first; the window runs from the first block not in the cache to the active block,
    so a finished block is stored in the next block's first forward."""
    prompt = torch.arange(6)  # absolute blocks: [4, 8) holds the prompt tail 4, 5; the last block ends at 16
    scheduler, log = decode(config(strategy="sequential"), [prompt])
    assert generated(scheduler, 0, 10).tolist() == token_at(torch.arange(6, 16)).tolist()
    assert [committed for _, _, committed in log] == [[1]] * 10
    spans = [(start[0], end[0]) for start, end, _ in log]
    assert spans == [(4, 8), (4, 8), (4, 12), (8, 12), (8, 12), (8, 12), (8, 16), (12, 16), (12, 16), (12, 16)]
    assert scheduler.num_forwards == 10


def test_store_forward_spends_a_forward_per_block():
    scheduler, log = decode(config(strategy="sequential", fused_store=False), [torch.arange(6)])
    store_only = [entry for entry in log if entry[2] == [0]]
    assert [(s[0], e[0]) for s, e, _ in store_only] == [(4, 8), (8, 12), (12, 16)]
    assert scheduler.num_forwards == 10 + 3


def test_threshold_commits_what_passes_and_forced_progress():
    confident = lambda positions: torch.where(positions % 2 == 0, 0.95, 0.2)  # noqa: E731
    scheduler, log = decode(config(strategy="low_confidence_dynamic", threshold=0.9, steps_per_block=2),
                            [torch.arange(4)], lambda r: made_up_scores(r, confident))
    # each block: the two even positions pass; the schedule asks for 2 per step, so they are enough
    assert [committed for _, _, committed in log] == [[2], [2], [2], [2]]


def test_full_recompute_spans_the_canvas():
    scheduler, log = decode(config(attention="bidirectional", alignment="prompt_end", strategy="sequential"),
                            [torch.arange(3), torch.arange(5)])
    assert all(start == [0, 0] for start, _, _ in log[:8])
    assert log[0][1] == [11, 13]
    assert generated(scheduler, 1, 8).tolist() == token_at(torch.arange(5, 13)).tolist()


@pytest.mark.parametrize("early_stop", [True, False])
def test_stop_token_ends_the_row_only_with_early_stop(early_stop):
    stop_at_9 = lambda positions: torch.where(positions == 9, STOP, token_at(positions))  # noqa: E731
    cfg = config(strategy="sequential", eos_token_id=[STOP], early_stop=early_stop)
    scheduler, log = decode(cfg, [torch.arange(6)], lambda r: made_up_scores(r, token=stop_at_9))
    tokens = generated(scheduler, 0, 8)
    assert int(tokens[3]) == STOP
    if early_stop:  # the stop token's block [8, 12) is decoded to its end, then the row stops
        assert scheduler.num_forwards == 6 and (tokens[6:] == MASK).all()
    else:
        assert scheduler.num_forwards == 10 and not (tokens == MASK).any()


def test_multi_block_adds_blocks_early_and_forces_the_lowest():
    cfg = config(strategy="entropy_threshold", threshold=0.1, max_active_blocks=3, block_add_threshold=0.5,
                 decoded_token_threshold=0.5, alignment="prompt_end", max_new_tokens=12)
    scheduler, log = decode(cfg, [torch.arange(4)])  # entropies never pass: one forced token per step
    assert [committed for _, _, committed in log] == [[1]] * 12
    assert max(end[0] - start[0] for start, end, _ in log) > 4  # windows span several blocks


def test_chunk_bound_holds_for_single_block_modes():
    for changes in (dict(), dict(fused_store=False)):
        cfg = config(strategy="sequential", **changes)
        scheduler, log = decode(cfg, [torch.arange(6), torch.arange(3)])
        bound = scheduler.chunk_bound()
        assert all(-(-(e - s) // scheduler.chunk) <= bound for start, end, _ in log for s, e in zip(start, end))


def confident(request, token=token_at) -> Scores:
    """Every candidate passes a 0.9 threshold (a block fills in one step) and any editing threshold below 0.95."""
    return made_up_scores(request, lambda positions: torch.full(positions.shape, 0.95), token)


def flipping(request) -> Scores:
    """Confident proposals that change at every step of a slot: every refinement step edits every decided token."""
    return confident(request, lambda positions: 10 + (request.counters[: len(positions)] + positions) % 2)


EDITING = dict(strategy="low_confidence_dynamic", threshold=0.9, editing_threshold=0.5, max_post_steps=2)


@pytest.mark.parametrize("scores, per_block, edits", [(confident, [2, 2, 2], 0), (flipping, [4, 4, 4], 30)])
def test_editing_refines_a_filled_block_while_it_edits(scores, per_block, edits):
    """A block filled in one step (before its S-th) keeps refining: a refinement step that edits nothing ends it,
    else at most max_post_steps + 1 of them; the prompt tail in the first block [4, 8) is never edited; blocks after
    the active one are added only when it ends (its K/V are stored in the next block's first forward)."""
    scheduler, log = decode(config(**EDITING), [torch.arange(6)], scores)
    ends = [end[0] for _, end, _ in log]  # a window ends with its active block
    assert [ends.count(8), ends.count(12), ends.count(16)] == per_block
    assert [sum(committed[0] for *_, committed in log)] == [10]  # the strategy commits each position once
    assert int(scheduler.state.edits[0]) == edits
    assert scheduler.state.canvas[0, :6].tolist() == list(range(6))
    assert not (generated(scheduler, 0, 10) == MASK).any()


def test_editing_without_refinement_when_the_block_fills_at_its_last_step():
    """sequential fills a block of 4 in its 4 scheduled steps (= S): no refinement step follows, though every step
    edits what the earlier ones committed; the prompt-tail block [4, 8) fills at step 2 and refines 2 + 1 steps."""
    scheduler, log = decode(config(**{**EDITING, "strategy": "sequential"}), [torch.arange(6)], flipping)
    assert scheduler.num_forwards == (2 + 3) + 4 + 4
    assert int(scheduler.state.edits[0]) == (1 + 3 * 2) + (1 + 2 + 3) * 2


@pytest.mark.parametrize("strategy, forwards", [("low_confidence_dynamic", 3), ("anti_sequential", 11)])
def test_editing_stops_after_a_step_that_wrote_the_stop_token(strategy, forwards):
    """diffusers' rule: a slot stops after a step that wrote a stop token when nothing before its first stop token
    is undecided. Filled at once, [8, 12) stops at its first step (no refinement); right to left, the stop token at 9
    is written while 8 is undecided and no later step writes one: the row decodes to its end."""
    stop_at_9 = lambda positions: torch.where(positions == 9, STOP, token_at(positions))  # noqa: E731
    cfg = config(**{**EDITING, "strategy": strategy, "eos_token_id": [STOP]})
    scheduler, log = decode(cfg, [torch.arange(6)], lambda r: confident(r, stop_at_9))
    assert int(generated(scheduler, 0, 8)[3]) == STOP
    assert scheduler.num_forwards == forwards


@pytest.mark.parametrize("field, value", [("editing_threshold", 0.0), ("editing_threshold", 1.5),
                                          ("max_post_steps", -1), ("max_post_steps", 1.0)])
def test_editing_fields_are_validated(field, value):
    with pytest.raises(ValueError, match=f"BlockDiffusionConfig.{field}="):
        config(**{field: value})
