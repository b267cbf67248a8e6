import pytest
import torch

triton = pytest.importorskip("triton")

import triton.language as tl  # noqa: E402

from hf_blockdiff.kernels.rng import row_key_tl, uniform_noise, uniform_noise_tl  # noqa: E402
from hf_blockdiff.kernels.scoring import (combine_shards_reference, combine_shards_triton,  # noqa: E402
                                          inverse_temperature, score_reference, score_shard_reference,
                                          score_shard_triton, score_triton, shard_top_logits, top_k_threshold)

MASK_ID = 5


def random_logits(N, V, dtype, device, seed, scale=3.0):
    """Random logits with one clear winner per row (tie-free argmax) and a large logit on the mask token."""
    gen = torch.Generator(device).manual_seed(seed)
    x = torch.randn(N, V, generator=gen, device=device) * scale
    winners = torch.randint(0, V, (N,), generator=gen, device=device)
    x[torch.arange(N, device=device), winners] = x.amax(dim=1) + 1.0
    x[:, MASK_ID] = x.amax(dim=1) + 5.0
    return x.to(dtype)


def row_seeds(N, device, seed):
    gen = torch.Generator(device).manual_seed(seed)
    return (torch.randint(-(2**62), 2**62, (N,), generator=gen, device=device),
            torch.randint(0, 2**40, (N,), generator=gen, device=device))


def check_scores(logits, temperature, top_k, seeds, assert_close, **kwargs):
    out = score_triton(logits, MASK_ID, temperature, top_k, *seeds, **kwargs)
    same_math = score_reference(logits, MASK_ID, temperature, top_k, *seeds)
    exact = score_reference(logits.double(), MASK_ID, temperature, top_k, *seeds)
    assert out[0].dtype == torch.int64 and all(t.dtype == torch.float32 for t in out[1:])
    assert torch.equal(out[0], same_math[0])
    assert (out[0] != MASK_ID).all()
    for got, ref in zip(out[1:], exact[1:]):
        assert_close(got, ref, torch.float32)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("V", [1001, 4099])
def test_greedy_matches_reference(dtype, V, device, assert_close, poisoned):
    logits = random_logits(6, V, dtype, device, seed=V)
    check_scores(logits, 0.0, 0, (None, None), assert_close, block_v=512)


def test_greedy_full_vocab(device, assert_close, poisoned):
    logits = random_logits(2, 151936, torch.bfloat16, device, seed=0)
    check_scores(logits, 0.0, 0, row_seeds(2, device, 0), assert_close)


def shards_threshold(logits, spans, temperature, top_k):
    """The whole rows' k-th largest kept z from every shard's k + 1 largest logits, as tensor parallel finds it; None
    where nothing is filtered."""
    if not (temperature > 0 and top_k > 0):
        return None
    tops = torch.cat([shard_top_logits(logits[:, first:end], first, MASK_ID, top_k) for first, end in spans], dim=1)
    return top_k_threshold(tops, top_k, inverse_temperature(temperature))


def tempered(logits, temperature):
    """z as the scoring kernel sees it: the logits times fl32(1 / T) when sampling, the mask token's -inf."""
    z = logits.float() * (inverse_temperature(temperature) if temperature > 0 else 1.0)
    z[:, MASK_ID] = float("-inf")
    return z


@pytest.mark.parametrize("temperature,top_k", [(0.0, 0), (0.8, 0), (0.8, 1), (0.8, 7)],
                         ids=["greedy", "sampled", "top-1", "top-7"])
@pytest.mark.parametrize("starts", [[0, 500], [0, 3, MASK_ID, MASK_ID + 1, 301, 900]], ids=["two", "six-uneven"])
def test_vocabulary_shards_combine_to_whole_rows(temperature, top_k, starts, device, assert_close, poisoned):
    """Each shard's state by the kernel is its reference's; combined (the kernel's states by the kernel, the
    reference's by the reference), the shards give the whole rows' scores: the proposal token for token (sampled: the
    noise of the shard's own ids; a tie across shards to the lowest id; the mask token's id, in the first shard or
    alone in one of its own, all -inf, never; top-k: the whole rows' k-th largest kept z found from every shard's k + 1
    largest logits, shards narrower than k + 1 and the mask token's largest logit among them), the statistics as
    fp64's."""
    V = 1001
    logits = random_logits(6, V, torch.float32, device, seed=11)
    logits[1, [10, 700]] = logits[1].sort(descending=True).values[1] + 1.0  # a tie across shards, below the mask's
    seeds = row_seeds(6, device, 3)
    spans = list(zip(starts, starts[1:] + [V]))
    threshold = shards_threshold(logits, spans, temperature, top_k)
    z = tempered(logits, temperature)
    if threshold is not None:
        assert torch.equal(threshold, z.topk(top_k, dim=1).values[:, -1])  # top_k_filter's k-th largest
    kept = z >= (threshold[:, None] if threshold is not None else -float("inf"))
    kept &= z > -float("inf")
    states = {combine_shards_triton: [], combine_shards_reference: []}
    for first, end in spans:
        shard = score_shard_triton(logits[:, first:end], first, MASK_ID, temperature, *seeds, threshold, block_v=256)
        reference = score_shard_reference(logits[:, first:end], first, MASK_ID, temperature, *seeds, threshold)
        picked = reference[-2].isfinite()  # a row of no kept token in the shard (the mask's alone) picks no id
        assert torch.equal(picked, kept[:, first:end].any(1))
        assert torch.equal(shard[-1][picked], reference[-1][picked])  # the pick's id
        torch.testing.assert_close(shard[:-1], reference[:-1], rtol=1e-5, atol=1e-5)
        states[combine_shards_triton].append(shard)
        states[combine_shards_reference].append(reference)
    whole = score_reference(logits, MASK_ID, temperature, top_k, *seeds)
    exact = score_reference(logits.double(), MASK_ID, temperature, top_k, *seeds)
    assert temperature > 0 or whole[0][1] == 10
    for combine, shards in states.items():
        out = combine(torch.stack(shards))
        assert torch.equal(out[0], whole[0])
        for got, ref in zip(out[1:], exact[1:]):
            assert_close(got, ref, torch.float32)


def test_top_k_of_the_whole_vocabulary_or_no_rows(device, assert_close, poisoned):
    """A k past the vocabulary keeps every token (its candidates are the vocabulary, not k of them: k = 10^10 would
    not fit in memory), as `top_k_filter` does; a batch of no rows scores none, with top-k too, whole and in shards."""
    logits = random_logits(3, 300, torch.float32, device, seed=4)
    seeds = row_seeds(3, device, 1)
    for top_k in (299, 300, 10**10):
        check_scores(logits, 0.8, top_k, seeds, assert_close)
        assert torch.equal(score_triton(logits, MASK_ID, 0.8, top_k, *seeds)[0],
                           score_triton(logits, MASK_ID, 0.8, 0, *seeds)[0])
    none = logits[:0]
    assert score_triton(none, MASK_ID, 0.8, 7, none[:, 0].long(), none[:, 0].long())[0].shape == (0,)
    assert shards_threshold(none, [(0, 150), (150, 300)], 0.8, 7).shape == (0,)


def test_greedy_ties_go_to_lowest_id(device, poisoned):
    logits = torch.zeros(3, 3000, device=device)
    logits[0, [2900, 700, 1500]] = 4.0  # ties in different chunks
    logits[1, [MASK_ID, 9, 10]] = torch.tensor([9.0, 4.0, 4.0], device=device)
    logits[2] = 1.0  # all tie: lowest id that is not the mask token
    proposal, confidence, entropy, margin, _ = score_triton(logits, MASK_ID, 0.0, 0, None, None, block_v=256)
    assert proposal.tolist() == [700, 9, 0]
    assert margin.tolist() == [0.0, 0.0, 0.0]
    assert torch.allclose(entropy[2], torch.tensor(2999.0, device=device).log())
    assert torch.allclose(confidence[2], torch.tensor(1 / 2999, device=device))


@pytest.mark.parametrize("temperature,top_k", [(1.0, 0), (0.6, 0), (1.7, 0), (1.0, 1), (0.8, 7), (1.0, 300)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sampling_matches_reference(temperature, top_k, dtype, device, assert_close, poisoned):
    logits = random_logits(8, 2053, dtype, device, seed=top_k, scale=1.5)
    seeds = row_seeds(8, device, seed=top_k)
    check_scores(logits, temperature, top_k, seeds, assert_close, block_v=512)


def test_top_k_keeps_boundary_ties(device, poisoned):
    logits = torch.zeros(1, 100, device=device)
    logits[0, MASK_ID] = 10.0
    logits[0, [10, 20]] = 3.0
    logits[0, [30, 40, 50]] = 2.0  # 3rd largest kept value, tied
    for counter in range(20):
        seeds = (torch.tensor([7], device=device), torch.tensor([counter], device=device))
        proposal, confidence, *_ = score_triton(logits, MASK_ID, 1.0, 3, *seeds)
        assert proposal.item() in (10, 20, 30, 40, 50)
        e3, e2 = torch.tensor(3.0).exp(), torch.tensor(2.0).exp()
        expect = (e3 if proposal.item() in (10, 20) else e2) / (2 * e3 + 3 * e2)
        assert torch.allclose(confidence.cpu(), expect[None])


def test_mask_token_never_proposed(device, poisoned):
    logits = torch.randn(64, 50, device=device)
    logits[:, MASK_ID] = 50.0
    seeds = row_seeds(64, device, seed=1)
    for temperature, top_k in [(0.0, 0), (1.0, 0), (2.0, 3)]:
        proposal = score_triton(logits, MASK_ID, temperature, top_k, *seeds)[0]
        assert (proposal != MASK_ID).all()


def test_extreme_noise_stays_finite_and_never_picks_excluded_tokens(device, poisoned):
    # With seed 0 the hash is at its maximum at token 5 for counter 9620923 and at token 7 for counter 404185:
    # u is then 1 - 2**-24, still below 1, so the Gumbel noise is large but finite.
    seed = torch.zeros(3, dtype=torch.long, device=device)
    counter = torch.tensor([9620923, 404185, 404185], device=device)
    assert uniform_noise(seed, counter, 8)[[0, 1], [MASK_ID, 7]].tolist() == [1 - 2**-24] * 2
    logits = torch.tensor([[0.0, 1.0, 2.0, 0.0, 0.0, 0.0, 0.0, 0.0]], device=device).repeat(3, 1)
    logits[2, 7] = 5.0  # top-2 keeps tokens 1 and 2 in rows 0 and 1 (token 7 filtered), 7 and 2 in row 2
    for score in (score_triton, score_reference):
        proposal = score(logits, MASK_ID, 1.0, 2, seed, counter)[0].tolist()
        assert proposal[0] in (1, 2) and proposal[1] in (1, 2) and proposal[2] == 7  # kept + infinite noise wins


@pytest.mark.parametrize("top_k", [0, 3])
def test_sampling_frequencies_follow_softmax(top_k, device):
    """The counter noise's Gumbel-max draws follow the tempered, top-k softmax. Drawn by the reference, which the
    kernel equals token for token (test_sampling_matches_reference): 1,500 rows of the kernel take 20 s under the
    CPU interpreter."""
    V, N, temperature = 8, 1500, 0.9
    base = torch.tensor([1.0, 0.2, 2.0, -1.0, 0.5, 3.0, 1.5, 0.0], device=device)
    logits = base.expand(N, V).contiguous()
    seeds = torch.full((N,), 1234, device=device), torch.arange(N, device=device)
    proposal = score_reference(logits, MASK_ID, temperature, top_k, *seeds)[0]
    z = (base / temperature).double().cpu()
    z[MASK_ID] = float("-inf")
    if top_k:
        z = z.masked_fill(z < z.topk(top_k).values[-1], float("-inf"))
    expected = torch.softmax(z, dim=0) * N
    counts = torch.bincount(proposal.cpu(), minlength=V).double()
    assert (counts[expected == 0] == 0).all()
    kept = expected > 0
    chi2 = ((counts[kept] - expected[kept]) ** 2 / expected[kept]).sum()
    assert chi2 < 30, f"chi-square {chi2:.1f} for {int(kept.sum())} categories"


@triton.jit
def _noise_kernel(seed_ptr, counter_ptr, out_ptr, V, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    key = row_key_tl(tl.load(seed_ptr + row), tl.load(counter_ptr + row))
    tokens = tl.arange(0, BLOCK)
    tl.store(out_ptr + row * V + tokens, uniform_noise_tl(key, tokens), mask=tokens < V)


def test_noise_twin_is_bit_identical(device):
    seed, counter = row_seeds(5, device, seed=3)
    seed[0], counter[0] = -1, 2**33 + 7  # values past 32 bits wrap the same way in both
    expected = uniform_noise(seed, counter, 1000)
    out = torch.full_like(expected, float("nan"))
    _noise_kernel[(5,)](seed, counter, out, 1000, BLOCK=1024)
    assert torch.equal(out, expected)


@pytest.mark.gpu
@pytest.mark.parametrize("temperature,top_k", [(0.0, 0), (1.0, 0), (0.7, 50)])
def test_full_vocab_batch_gpu(temperature, top_k, assert_close):
    logits = random_logits(512, 151936, torch.bfloat16, "cuda", seed=top_k)
    check_scores(logits, temperature, top_k, row_seeds(512, "cuda", seed=1), assert_close)


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_rows_of_nan_or_minus_inf_give_token_zero_and_nonfinite_confidence(temperature, device):
    """A broken row never proposes an id past the vocabulary (an embedding lookup of it would fault); its
    confidence is not finite, which stops the call (scheduler.check_scores)."""
    logits = random_logits(3, 1001, torch.float32, device, seed=3)
    logits[0] = float("nan")
    logits[1] = float("-inf")
    proposal, confidence, *_ = score_triton(logits, MASK_ID, temperature, 0, *row_seeds(3, device, 1), block_v=256)
    assert proposal[:2].tolist() == [0, 0] and 0 < proposal[2] < 1001
    assert not torch.isfinite(confidence[:2]).any() and torch.isfinite(confidence[2])
