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
    masked, c, h, m, n = row["masked"], row["confidence"], row["entropy"], row["margin"], row["scheduled"]
    idx = [i for i in range(len(masked)) if masked[i]]
    forced = row["forced"]
    if name in ("sequential", "anti_sequential", "low_confidence_static", "random", "least_entropy", "top2_margin"):
        if not forced:
            return set()
        ranked = {
            "sequential": idx, "anti_sequential": idx[::-1], "low_confidence_static": order(c, masked, True),
            "random": order(row["noise"], masked, False), "least_entropy": order(h, masked, False),
            "top2_margin": order(m, masked, True),
        }[name]
        return set(ranked[:n])
    if name == "low_confidence_dynamic":
        passing = {i for i in idx if above(c[i], p.threshold, p.strict)}
        if forced and len(passing) < n:
            return set((order(c, masked, True) if p.fallback == "topk" else idx)[:n])
        return passing
    if name == "confidence_threshold":
        passing = {i for i in idx if above(c[i], p.threshold, p.strict)}
        return passing | (set(order(c, masked, True)[:1]) if forced else set())
    if name == "confidence_factor":
        ranked = order(c, masked, True)
        k = 0
        for r, i in enumerate(ranked, 1):
            if r > 1 and c[i] < 1 - p.factor / (r + 1):
                break
            k = r
        if k == len(ranked) - 1:
            k = len(ranked)
        return set(ranked[:k])
    if name == "entropy_threshold":
        return forced_top1({i for i in idx if above(p.threshold, h[i], p.strict)}, row, "entropy", False)  # H < τ
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
    if name == "causal_waterfall":
        chosen = set()
        for i in idx:
            if not above(c[i], p.threshold, p.strict):
                break
            chosen.add(i)
        return chosen or ({idx[0]} if forced and idx else set())
    if name == "relative_top":
        best = max((c[i] for i in idx), default=0.0)
        return forced_top1({i for i in idx if c[i] >= p.relative_alpha * best}, row, "confidence", True)
    if name == "consensus_commit":
        agree = {i for i in idx if row["proposal"][i] == row["previous"][i] and above(c[i], p.threshold, p.strict)}
        return forced_top1(agree, row, "confidence", True)
    if name == "logit_salience":
        return forced_top1({i for i in idx if above(row["salience"][i], p.threshold, p.strict)}, row, "salience", True)
    if name in ("maskgit_plus", "topk_margin", "entropy"):
        if not forced:
            return set()
        t = 1 - (1 - p.dream_eps) * row["step"] / p.steps
        s = 1 - (1 - p.dream_eps) * (row["step"] + 1) / p.steps
        count = len(idx) if row["step"] >= p.steps - 1 else math.floor(len(idx) * (1 - s / t))
        score = {"maskgit_plus": c, "topk_margin": m, "entropy": [-x for x in h]}[name]
        return set(order(score, masked, True)[:count])
    raise KeyError(name)


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
