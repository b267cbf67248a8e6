"""Every strategy against a plain NumPy version, row by row, on random scores with ties."""

import math

import numpy as np
import pytest
import torch

from hf_blockdiff.strategies import STRATEGIES, BlockScores, StrategyParams, dream_count


def order(values, masked, descending):
    """Masked positions sorted by value (ties → lowest position)."""
    idx = [i for i in range(len(values)) if masked[i]]
    return sorted(idx, key=lambda i: (-values[i] if descending else values[i], i))


def forced_top1(chosen, row, key, descending):
    if row["forced"] and not chosen and any(row["masked"]):
        chosen = {order(row[key], row["masked"], descending)[0]}
    return chosen


def above(value, threshold, strict):
    return value > threshold if strict else value >= threshold


def numpy_strategy(name, row, p):
    """The positions strategy `name` commits in one block row, written out plainly (one function per kind)."""
    for kind in (ranked_strategy, threshold_strategy, running_strategy, dream_strategy):
        chosen = kind(name, row, p)
        if chosen is not None:
            return chosen
    raise KeyError(name)


def positions(masked):
    return [i for i in range(len(masked)) if masked[i]]


def ranked_strategy(name, row, p):
    """The scheduled count of masked positions by an order (None: not such a strategy)."""
    masked, c, h, m = row["masked"], row["confidence"], row["entropy"], row["margin"]
    orders = {"sequential": lambda: positions(masked), "anti_sequential": lambda: positions(masked)[::-1],
              "low_confidence_static": lambda: order(c, masked, True),
              "random": lambda: order(row["noise"], masked, False), "least_entropy": lambda: order(h, masked, False),
              "top2_margin": lambda: order(m, masked, True)}
    if name not in orders:
        return None
    return set(orders[name]()[:row["scheduled"]]) if row["forced"] else set()


def threshold_strategy(name, row, p):
    """A set by a per-position test, plus a forced token (None: not such a strategy)."""
    masked, c, h, forced = row["masked"], row["confidence"], row["entropy"], row["forced"]
    idx = positions(masked)
    if name == "low_confidence_dynamic":
        passing = {i for i in idx if above(c[i], p.threshold, p.strict)}
        if forced and len(passing) < row["scheduled"]:
            return set((order(c, masked, True) if p.fallback == "topk" else idx)[:row["scheduled"]])
        return passing
    if name == "confidence_threshold":
        passing = {i for i in idx if above(c[i], p.threshold, p.strict)}
        return passing | (set(order(c, masked, True)[:1]) if forced else set())
    if name == "entropy_threshold":
        return forced_top1({i for i in idx if above(p.threshold, h[i], p.strict)}, row, "entropy", False)  # H < τ
    if name == "relative_top":
        best = max((c[i] for i in idx), default=0.0)
        return forced_top1({i for i in idx if c[i] >= p.relative_alpha * best}, row, "confidence", True)
    if name == "consensus_commit":
        agree = {i for i in idx if row["proposal"][i] == row["previous"][i] and above(c[i], p.threshold, p.strict)}
        return forced_top1(agree, row, "confidence", True)
    if name == "logit_salience":
        return forced_top1({i for i in idx if above(row["salience"][i], p.threshold, p.strict)}, row, "salience", True)
    return None


def running_strategy(name, row, p):
    """A prefix of an order while a running quantity holds (None: not such a strategy)."""
    masked, c, h = row["masked"], row["confidence"], row["entropy"]
    if name == "confidence_factor":
        ranked, k = order(c, masked, True), 0
        for r, i in enumerate(ranked, 1):
            if r > 1 and c[i] < 1 - p.factor / (r + 1):
                break
            k = r
        return set(ranked[:len(ranked) if k == len(ranked) - 1 else k])
    if name == "causal_waterfall":
        idx, chosen = positions(masked), set()
        for i in idx:
            if not above(c[i], p.threshold, p.strict):
                break
            chosen.add(i)
        return chosen or ({idx[0]} if row["forced"] and idx else set())
    if name == "entropy_bounded":
        total, chosen = 0.0, set()
        for i in order(h, masked, False):
            total += h[i]
            if not total < p.entropy_budget:
                break
            chosen.add(i)
        return forced_top1(chosen, row, "entropy", False)
    if name == "dynamic_pmax":
        product, chosen = 1.0, set()
        for i in order(c, masked, True):
            product *= c[i]
            if not product >= p.threshold:
                break
            chosen.add(i)
        return forced_top1(chosen, row, "confidence", True)
    return None


def dream_strategy(name, row, p):
    """Dream's schedule by a score (None: not such a strategy)."""
    if name not in ("maskgit_plus", "topk_margin", "entropy"):
        return None
    if not row["forced"]:
        return set()
    masked = row["masked"]
    t = 1 - (1 - p.dream_eps) * row["step"] / p.steps
    s = 1 - (1 - p.dream_eps) * (row["step"] + 1) / p.steps
    remaining = len(positions(masked))
    count = remaining if row["step"] >= p.steps - 1 else math.floor(remaining * (1 - s / t))
    score = {"maskgit_plus": row["confidence"], "topk_margin": row["margin"],
             "entropy": [-x for x in row["entropy"]]}[name]
    return set(order(score, masked, True)[:count])


def random_scores(generator, blocks, length, ties):
    def values(scale=1.0):
        v = torch.rand(blocks, length, generator=generator) * scale
        return (v * 4).round() / 4 if ties else v

    masked = torch.rand(blocks, length, generator=generator) < 0.7
    proposal = torch.randint(0, 3, (blocks, length), generator=generator)
    return BlockScores(
        masked=masked, confidence=values(), entropy=values(3.0), margin=values(), forced=torch.rand(blocks, generator=generator) < 0.7,
        scheduled=torch.randint(0, length + 1, (blocks,), generator=generator),
        step=torch.randint(0, 6, (blocks,), generator=generator), proposal=proposal,
        previous=torch.where(torch.rand(blocks, length, generator=generator) < 0.5, proposal, -1),
        salience=values(12.0), noise=values(),
    )


@pytest.mark.parametrize("name", sorted(STRATEGIES))
@pytest.mark.parametrize("ties", [False, True])
def test_strategy_matches_numpy(name, ties):
    generator = torch.Generator().manual_seed(hash(name) % 1000 + ties)
    for trial in range(12):
        length = [1, 4, 8, 32][trial % 4]
        s = random_scores(generator, blocks=16, length=length, ties=ties)
        params = StrategyParams(
            threshold=[0.0, 0.25, 0.5, 0.75, 1.0][trial % 5] * (12.0 if name == "logit_salience" else 1.0),
            fallback=["topk", "leftmost"][trial % 2], strict=bool(trial % 3), entropy_budget=[0.5, 2.0, 6.0][trial % 3],
            relative_alpha=[0.5, 0.9, 1.0][trial % 3], factor=[0.5, 1.0, 2.0][trial % 3], steps=[1, 4, 8][trial % 3],
        )
        got = STRATEGIES[name].select(s, params)
        assert not (got & ~s.masked).any()
        for b in range(16):
            row = {k: getattr(s, k)[b].tolist() for k in ("masked", "confidence", "entropy", "margin", "proposal",
                                                        "previous", "salience", "noise")}
            row.update(forced=bool(s.forced[b]), scheduled=int(s.scheduled[b]), step=int(s.step[b]))
            expected = numpy_strategy(name, row, params)
            assert set(np.flatnonzero(got[b].numpy()).tolist()) == expected, (name, trial, b, row)


# the key of the forced token of each rule that forces one only when none passes: (BlockScores field, descending)
FORCED_KEYS = {"entropy_threshold": ("entropy", False), "entropy_bounded": ("entropy", False),
               "dynamic_pmax": ("confidence", True), "causal_waterfall": ("position", False),
               "relative_top": ("confidence", True), "consensus_commit": ("confidence", True),
               "logit_salience": ("salience", True)}


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_all_active_scope_matches_numpy(name):
    """forced_token_scope="all_active": each slot (4 consecutive rows) where no row passes also takes the best
    masked position over all its rows (ties → the lowest row, then position); other rules ignore the scope."""
    generator = torch.Generator().manual_seed(hash(name) % 1000)
    assert STRATEGIES[name].forced_top1 == (name in FORCED_KEYS)
    slot_added = 0
    for trial in range(12):
        s = random_scores(generator, blocks=16, length=[1, 4, 8][trial % 3], ties=bool(trial % 2))
        s.slot_blocks = 4
        threshold = [0.0, 0.25, 0.5] if name == "entropy_threshold" else [0.75, 0.9, 1.0]  # slots often stall
        params = StrategyParams(threshold=threshold[trial % 3] * (12.0 if name == "logit_salience" else 1.0),
                                strict=bool(trial % 3), entropy_budget=0.25, forced_token_scope="all_active")
        got = STRATEGIES[name].select(s, params)
        for slot in range(4):
            rows = []
            for b in range(4 * slot, 4 * slot + 4):
                row = {k: getattr(s, k)[b].tolist() for k in ("masked", "confidence", "entropy", "margin",
                                                            "proposal", "previous", "salience", "noise")}
                row.update(forced=bool(s.forced[b]), scheduled=int(s.scheduled[b]), step=int(s.step[b]),
                           position=list(range(len(row["masked"]))))
                rows.append(row)
            expected = [numpy_strategy(name, row, params) for row in rows]
            passing = [numpy_strategy(name, dict(row, forced=False), params) for row in rows]
            if name in FORCED_KEYS and not any(passing):
                key, descending = FORCED_KEYS[name]
                ranked = sorted((-row[key][i] if descending else row[key][i], r, i)
                                for r, row in enumerate(rows) for i in range(len(row["masked"])) if row["masked"][i])
                if ranked:
                    slot_added += ranked[0][2] not in expected[ranked[0][1]]
                    expected[ranked[0][1]] = expected[ranked[0][1]] | {ranked[0][2]}
            for r, b in enumerate(range(4 * slot, 4 * slot + 4)):
                assert set(np.flatnonzero(got[b].numpy()).tolist()) == expected[r], (name, trial, b)
    if name != "relative_top":  # its best candidate always passes, so no slot stalls
        assert (slot_added > 0) == (name in FORCED_KEYS)  # the slot-wide token made a difference somewhere


def test_dynamic_pmax_commits_one_token_at_threshold_one():
    s = random_scores(torch.Generator().manual_seed(0), blocks=8, length=8, ties=False)
    s.forced[:] = True
    s.confidence = s.confidence.clamp(max=0.999)
    got = STRATEGIES["dynamic_pmax"].select(s, StrategyParams(threshold=1.0))
    assert (got.sum(-1) == s.masked.any(-1).long()).all()
    s.confidence[:, 0] = 1.0
    got = STRATEGIES["dynamic_pmax"].select(s, StrategyParams(threshold=1.0))
    assert (got.sum(-1)[s.masked[:, 0]] >= 1).all()


def test_low_confidence_dynamic_threshold_zero_takes_everything():
    s = random_scores(torch.Generator().manual_seed(1), blocks=8, length=8, ties=False)
    s.confidence = s.confidence.clamp(min=1e-3)
    got = STRATEGIES["low_confidence_dynamic"].select(s, StrategyParams(threshold=0.0))
    assert torch.equal(got, s.masked)


def test_dream_schedule_is_the_linspace_rule():
    masked = torch.ones(1, 64, dtype=torch.bool)
    s = BlockScores(masked, *(torch.zeros(1, 64),) * 3, torch.zeros(1, dtype=torch.long), torch.ones(1, dtype=torch.bool),
                    torch.tensor([0]))
    timesteps = np.linspace(1, 1e-3, 9)
    expected = int(64 * (1 - timesteps[1] / timesteps[0]))
    assert int(dream_count(s, StrategyParams(threshold=0.0, steps=8))) == expected
    s.step = torch.tensor([7])
    assert int(dream_count(s, StrategyParams(threshold=0.0, steps=8))) == 64
