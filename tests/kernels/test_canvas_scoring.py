import pytest
import torch

pytest.importorskip("triton")

from hf_blockdiff.kernels.canvas_scoring import canvas_score_reference, canvas_score_triton  # noqa: E402


def step_inputs(N, V, dtype, device, seed):
    """Raw logits with a clear argmax per row and the row seeds/counters of a step."""
    gen = torch.Generator(device).manual_seed(seed)
    logits = torch.randn(N, V, generator=gen, device=device) * 2
    winners = torch.randint(0, V, (N,), generator=gen, device=device)
    logits[torch.arange(N, device=device), winners] = logits.amax(dim=1) + 0.5
    seeds = torch.randint(-(2**62), 2**62, (N,), generator=gen, device=device)
    counters = torch.randint(0, 2**32, (N,), generator=gen, device=device)
    return logits.to(dtype), seeds, counters


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("softcap", [None, 30.0])
@pytest.mark.parametrize("V", [1003, 2048])
def test_fused_canvas_scores_match_the_reference(dtype, softcap, V, device, assert_close, poisoned):
    logits, seeds, counters = step_inputs(6, V, dtype, device, seed=V)
    temperature = torch.tensor(0.7, device=device)
    out = canvas_score_triton(logits, softcap, temperature, seeds, counters, dtype, block_v=256)
    same = canvas_score_reference(logits, softcap, temperature, seeds, counters, dtype)
    exact = canvas_score_reference(logits.double(), softcap, temperature.double(), seeds, counters, torch.float64)
    assert torch.equal(out[0], same[0]) and torch.equal(out[1], same[1])  # sample, argmax
    assert not torch.equal(out[0], out[1])  # the noise moves samples off the argmax
    for got, ref in zip(out[2:4], exact[2:4]):  # entropy, logprob
        assert_close(got, ref, torch.float32)
    assert out[4].dtype == dtype
    # softmax of the logits rounded to the model dtype, as transformers' (the kernel's exp apart: bfloat16 values
    # equal but for a rare 1-ulp rounding difference; float32 within 128 ulps, the kernel's tanh being
    # 1 − 2 / (e^(2y) + 1))
    ulps = (out[4] - same[4]).abs() / (same[4].abs() * torch.finfo(dtype).eps)
    assert ulps.max() <= (1 if dtype == torch.bfloat16 else 128)
    assert dtype == torch.float32 or (ulps > 0).float().mean() < 0.01


def test_fused_canvas_scores_follow_the_temperature(device):
    """Colder logits sharpen the distribution: lower entropy, the same argmax."""
    logits, seeds, counters = step_inputs(4, 777, torch.float32, device, seed=1)
    warm = canvas_score_triton(logits, 30.0, torch.tensor(0.8, device=device), seeds, counters, torch.float32,
                               block_v=256)
    cold = canvas_score_triton(logits, 30.0, torch.tensor(0.4, device=device), seeds, counters, torch.float32,
                               block_v=256)
    assert torch.equal(warm[1], cold[1]) and (cold[2] < warm[2]).all()


def test_fused_canvas_scores_refuse_other_dtypes(device):
    logits, seeds, counters = step_inputs(2, 64, torch.float16, device, seed=2)
    with pytest.raises(ValueError, match="probs_dtype"):
        canvas_score_triton(logits, None, torch.tensor(1.0, device=device), seeds, counters, torch.float16)


@pytest.mark.parametrize("block_v", [None, 1024])
def test_default_launch_over_a_vocabulary_of_several_chunks(block_v, device, assert_close, poisoned):
    """The launches the library uses (default chunk of 4096 columns below 1,024 rows, 1,024 from there) over a
    vocabulary that ends in a partial chunk."""
    logits, seeds, counters = step_inputs(3, 10_000, torch.bfloat16, device, seed=11)
    temperature = torch.tensor(0.5, device=device)
    out = canvas_score_triton(logits, 30.0, temperature, seeds, counters, torch.bfloat16, block_v=block_v)
    ref = canvas_score_reference(logits, 30.0, temperature, seeds, counters, torch.bfloat16)
    assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])
    for got, expected in zip(out[2:4], ref[2:4]):
        assert_close(got, expected, torch.float32)
    assert_close(out[4].float(), ref[4].float(), torch.bfloat16)


def test_rows_of_nan_give_token_zero_and_nonfinite_entropy(device):
    """A NaN row samples and argmaxes token 0, never an id past the vocabulary (the next step embeds it); its
    entropy is NaN, which stops the call (canvas.schedule.CanvasState.status)."""
    logits, seeds, counters = step_inputs(2, 1003, torch.float32, device, seed=4)
    logits[0] = float("nan")
    out = canvas_score_triton(logits, 30.0, torch.tensor(0.7, device=device), seeds, counters, torch.float32,
                              block_v=256)
    assert out[0][0] == 0 and out[1][0] == 0 and torch.isnan(out[2][0])
    assert 0 < out[1][1] < 1003 and torch.isfinite(out[2][1])


def test_one_nan_or_infinities_make_the_row_nonfinite(device):
    """A single nan among finite logits, and ±inf beside a nan under the soft cap (an overflowed hidden state), are
    not dropped: the row's entropy and log-probability come out non-finite, as the reference's, and the ids stay in
    the vocabulary."""
    logits, seeds, counters = step_inputs(3, 1003, torch.float32, device, seed=5)
    logits[0, 17] = float("nan")
    logits[1, 3], logits[1, 40], logits[1, 900] = float("inf"), float("-inf"), float("nan")
    temperature = torch.tensor(0.7, device=device)
    out = canvas_score_triton(logits, 30.0, temperature, seeds, counters, torch.float32, block_v=256)
    ref = canvas_score_reference(logits, 30.0, temperature, seeds, counters, torch.float32)
    for row in (0, 1):
        assert not torch.isfinite(ref[2][row]) and not torch.isfinite(out[2][row])
        assert not torch.isfinite(out[3][row])
        assert 0 <= out[0][row] < 1003 and 0 <= out[1][row] < 1003
    assert torch.isfinite(out[2][2]) and torch.isfinite(out[3][2])


def test_tied_maxima_give_the_lowest_id(device):
    """Equal largest logits in one lane of one chunk, in two lanes, and in two chunks: the argmax is the lowest id,
    as torch's."""
    logits, seeds, counters = step_inputs(3, 1003, torch.float32, device, seed=6)
    top = logits.amax(dim=1, keepdim=True) + 1
    for row, ids in enumerate([(300, 44), (45, 44), (900, 301)]):  # chunks of 256: same lane; two lanes; two chunks
        logits[row, list(ids)] = top[row]
    out = canvas_score_triton(logits, None, torch.tensor(1.0, device=device), seeds, counters, torch.float32,
                              block_v=256)
    assert out[1].tolist() == [44, 44, 301]
