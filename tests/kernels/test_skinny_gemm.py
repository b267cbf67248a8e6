import contextlib

import pytest
import torch
import torch.nn.functional as F

from hf_blockdiff.kernels import skinny_gemm
from hf_blockdiff.kernels.skinny_gemm import (
    MAX_ROWS, ONE_WEIGHT_MAX_ROWS, gated_linear, gated_linear_reference, grouped_linear, grouped_linear_reference,
    linear_into, linear_residual, linear_residual_reference, stacked,
)

pytest.importorskip("triton")


def _tensors(device, dtype, rows, width, outs, seed):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, width, generator=generator).to(device, dtype)
    weights = [(torch.randn(n, width, generator=generator) / width**0.5).to(device, dtype) for n in outs]
    biases = [torch.randn(n, generator=generator).to(device, dtype) for n in outs]
    return x, weights, biases


@pytest.mark.parametrize("rows", [1, 5, 16, 33, MAX_ROWS])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("count", [1, 3])
def test_grouped_linear_matches_fp64(device, poisoned, rows, dtype, with_bias, count, assert_close):
    """One or three outputs of widths that are no multiple of a tile, rows padded inside the kernel (one weight past
    ONE_WEIGHT_MAX_ROWS: cuBLAS)."""
    x, weights, biases = _tensors(device, dtype, rows, 300, (96, 40, 17)[:count], seed=rows)
    biases = biases if with_bias else [None] * count
    outputs = grouped_linear(x, weights, biases)
    expected = grouped_linear_reference(x.double(), [w.double() for w in weights],
                                        [b if b is None else b.double() for b in biases])
    for out, ref, weight in zip(outputs, expected, weights):
        assert out.shape == (rows, weight.shape[0]) and out.dtype == dtype
        assert_close(out, ref, dtype)


@pytest.mark.parametrize("rows", [1, 16, 20, 37, MAX_ROWS])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_gated_linear_rounds_like_the_gated_mlp(device, poisoned, rows, dtype, assert_close):
    """silu(x·gateᵀ)·(x·upᵀ) with each projection and the activation rounded to the dtype, as transformers rounds."""
    x, (gate, up), _ = _tensors(device, dtype, rows, 520, (200, 200), seed=rows)
    out = gated_linear(x, gate, up)
    g, u = ((x.double() @ w.double().T).to(dtype) for w in (gate, up))
    expected = (F.silu(g.double()).to(dtype).double() * u.double()).to(dtype)
    assert out.shape == (rows, 200) and out.dtype == dtype
    assert_close(out, expected, dtype)
    if dtype == torch.bfloat16:  # a projection rounds the other way where fp32 sums straddle a bf16 midpoint
        assert (out != gated_linear_reference(x, gate, up)).float().mean() < 0.05


@pytest.mark.parametrize("rows", [4, ONE_WEIGHT_MAX_ROWS])
def test_linear_into_writes_the_grouped_product_into_the_given_memory(device, rows):
    """`linear_into` writes into a view of a larger buffer (the symmetric buffer's start) what `grouped_linear`
    returns for the one weight, bit for bit, and nothing past it; a wrong `out` is refused."""
    x, (weight,), _ = _tensors(device, torch.bfloat16, rows, 300, (96,), seed=rows)
    buffer = torch.full((rows * 96 + 8,), 7.0, dtype=torch.bfloat16, device=device)
    linear_into(x, weight, buffer[: rows * 96].view(rows, 96))
    assert torch.equal(buffer[: rows * 96].view(rows, 96), grouped_linear(x, [weight], [None])[0])
    assert bool((buffer[rows * 96:] == 7).all())
    with pytest.raises(ValueError, match=rf"out must be a contiguous \[{rows}, 96\] torch.bfloat16"):
        linear_into(x, weight, torch.empty(rows, 95, dtype=torch.bfloat16, device=device))


def test_more_rows_than_the_kernel_takes_go_to_cublas(device):
    """Past MAX_ROWS (one weight: ONE_WEIGHT_MAX_ROWS) the ops return torch's own results, bit for bit."""
    x, weights, biases = _tensors(device, torch.bfloat16, MAX_ROWS + 1, 64, (32, 48), seed=9)
    for out, ref in zip(grouped_linear(x, weights, biases), grouped_linear_reference(x, weights, biases)):
        assert torch.equal(out, ref)
    assert torch.equal(gated_linear(x, *weights[:1] * 2), gated_linear_reference(x, *weights[:1] * 2))
    few = x[:ONE_WEIGHT_MAX_ROWS + 1]
    (out,) = grouped_linear(few, weights[:1], [None])
    assert torch.equal(out, grouped_linear_reference(few, weights[:1], [None])[0])


def test_stacked_finds_tensors_back_to_back_in_one_storage():
    buffer = torch.arange(24.0).view(6, 4)
    q, k, v = buffer.split([3, 2, 1])
    assert torch.equal(stacked([q, k, v]), buffer) and stacked([q, k, v]).data_ptr() == buffer.data_ptr()
    assert torch.equal(stacked([k, v]), buffer[3:])
    assert stacked([q, v]) is None  # a gap
    assert stacked([k, q]) is None  # out of order
    assert stacked([q, q]) is None  # the same tensor twice (a test above passes gate as up)
    assert stacked([q, torch.zeros(2, 4)]) is None  # another storage
    assert stacked([buffer[:, :2], buffer[:, 2:]]) is None  # not contiguous
    assert stacked([buffer.view(-1)[:8].view(2, 4), buffer.view(-1)[8:12].view(2, 2)]) is None  # another width


def _stacked_weights(device, dtype, rows, width, outs, seed):
    """x and weights of `outs` rows lying back to back in one buffer."""
    x, weights, biases = _tensors(device, dtype, rows, width, outs, seed)
    return x, list(torch.cat(weights).split(list(outs))), list(torch.cat(biases).split(list(outs)))


@pytest.mark.parametrize("rows", [5, MAX_ROWS + 1])
def test_stacked_gate_and_up_are_one_gemm_past_the_kernel(device, rows, monkeypatch, assert_close):
    """Gate and up side by side (a sharded model's packed shards): past MAX_ROWS one GEMM over both, rounded as the
    gated MLP rounds; up to it the kernel, as for any gate and up."""
    x, (gate, up), _ = _stacked_weights(device, torch.bfloat16, rows, 64, (40, 40), seed=rows)
    calls = []
    linear = F.linear
    monkeypatch.setattr(F, "linear", lambda *args: calls.append(args[1].shape) or linear(*args))
    out = gated_linear(x, gate, up)
    both = linear(x, torch.cat([gate, up]))
    assert calls == ([(80, 64)] if rows > MAX_ROWS else [])
    if rows > MAX_ROWS:
        assert torch.equal(out, F.silu(both[:, :40]) * both[:, 40:])
    assert_close(out, gated_linear_reference(x.double(), gate.double(), up.double()), torch.bfloat16)


@pytest.mark.parametrize("rows", [ONE_WEIGHT_MAX_ROWS + 1, MAX_ROWS, MAX_ROWS + 1])
def test_one_stacked_weight_takes_the_grouped_row_limit(device, rows, monkeypatch):
    """q/k/v stacked into one weight run in the kernel up to MAX_ROWS, as the three weights would (one weight alone
    goes to cuBLAS past ONE_WEIGHT_MAX_ROWS), and give the three outputs side by side."""
    x, weights, biases = _stacked_weights(device, torch.float32, rows, 48, (32, 16, 16), seed=rows)
    launches, launch = [], skinny_gemm._launch
    monkeypatch.setattr(skinny_gemm, "_launch", lambda *args, **kwargs: launches.append(1) or launch(*args, **kwargs))
    (out,) = grouped_linear(x, [stacked(weights)], [stacked(biases)], max_rows=MAX_ROWS)
    assert len(launches) == (rows <= MAX_ROWS)
    three = grouped_linear(x, weights, biases)
    torch.testing.assert_close(out, torch.cat(three, dim=1), atol=1e-5, rtol=1e-5)


def test_bad_shapes_are_refused():
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match=r"x must be \[rows, in_features\]"):
        grouped_linear(x[None], [torch.randn(4, 8)], [None])
    with pytest.raises(ValueError, match="weights must be contiguous"):
        grouped_linear(x[:2], [torch.randn(4, 9)], [None])
    with pytest.raises(ValueError, match=r"biases must be contiguous \[4\]"):
        grouped_linear(x, [torch.randn(4, 8)], [torch.randn(8)[::2]])
    with pytest.raises(ValueError, match="one bias"):
        grouped_linear(x[:2], [torch.randn(4, 8)], [None, None])
    with pytest.raises(ValueError, match="gate and up must have one shape"):
        gated_linear(x[:2], torch.randn(4, 8), torch.randn(5, 8))


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [4, 8, 32, 64])
def test_sdar_4b_shapes_gpu(rows, assert_close):
    """The shapes the kernels are tuned for (SDAR-4B's q/k/v, gate/up, down), against cuBLAS."""
    x, weights, _ = _tensors("cuda", torch.bfloat16, rows, 2560, (4096, 1024, 1024), seed=rows)
    for out, ref in zip(grouped_linear(x, weights, [None] * 3), grouped_linear_reference(x, weights, [None] * 3)):
        assert_close(out, ref.double(), torch.bfloat16)
    _, (gate, up), _ = _tensors("cuda", torch.bfloat16, rows, 2560, (9728, 9728), seed=rows + 1)
    assert_close(gated_linear(x, gate, up), gated_linear_reference(x, gate, up).double(), torch.bfloat16)
    compiled = torch.compile(lambda h: gated_linear(h, gate, up), fullgraph=True)
    assert torch.equal(compiled(x), gated_linear(x, gate, up))


@pytest.mark.parametrize("limit,block_k", [(None, 512), (232448, 256), (101376, 128)],
                         ids=["interpreter", "H100", "consumer"])
def test_width_4096_fitted_to_the_device(device, poisoned, limit, block_k, monkeypatch, assert_close):
    """SDAR-8B's q/k/v (width 4096, 6,144 columns): K steps of 512 where nothing limits them, equal to the reference,
    and the smaller configurations chosen for 227 KiB and 99 KiB of shared memory per block (K steps of 256 and 128
    compute in test_grouped_linear_matches_fp64; under the interpreter a launch at this width takes 7-14 s, so those
    two are chosen, not launched)."""
    from hf_blockdiff.kernels import skinny_gemm
    from hf_blockdiff.kernels.device_limits import assumed_shared_memory

    launched = []

    def recording(kernel, grid, *args, configs, **kwargs):
        launched.append(configs[0])
        if limit is None:
            launch(kernel, grid, *args, configs=configs, **kwargs)

    launch = skinny_gemm.launch
    monkeypatch.setattr(skinny_gemm, "launch", recording)
    x, weights, biases = _tensors(device, torch.bfloat16, 4, 4096, (4096, 1024, 1024), seed=4)
    if limit is None and x.is_cuda:  # no assumed limit on a GPU: the device's own choice, launched and compared
        block_k = skinny_gemm.device_configs(x, (4096, 1024, 1024), False)[0]["BLOCK_K"]
    with assumed_shared_memory(limit) if limit else contextlib.nullcontext():
        outputs = grouped_linear(x, weights, biases)
    assert launched == [{"BLOCK_N": 64, "BLOCK_K": block_k, "num_stages": 4}]
    if limit is None:
        expected = grouped_linear_reference(x.double(), [w.double() for w in weights], [b.double() for b in biases])
        for out, ref in zip(outputs, expected):
            assert_close(out, ref, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("shards", [1, 2, 4])
@pytest.mark.parametrize("rows", [1, 4, 16, 32, 64])
def test_sdar_8b_shapes_gpu(rows, shards, assert_close):
    """SDAR-8B's q/k/v (whose K steps of 512 asked an H200 for 240 KiB of shared memory), gate/up, o and down, on one
    GPU and a tensor-parallel rank's shards, against cuBLAS: every configuration fits the device."""
    x, weights, _ = _tensors("cuda", torch.bfloat16, rows, 4096, (4096 // shards, 1024 // shards, 1024 // shards),
                             seed=rows)
    for out, ref in zip(grouped_linear(x, weights, [None] * 3), grouped_linear_reference(x, weights, [None] * 3)):
        assert_close(out, ref.double(), torch.bfloat16)
    _, (gate, up), _ = _tensors("cuda", torch.bfloat16, rows, 4096, (12288 // shards,) * 2, seed=rows + 1)
    assert_close(gated_linear(x, gate, up), gated_linear_reference(x, gate, up).double(), torch.bfloat16)
    residual = torch.randn(rows, 4096, device="cuda", dtype=torch.bfloat16)
    for width in (4096 // shards, 12288 // shards):  # o, down
        inner, (weight,), _ = _tensors("cuda", torch.bfloat16, rows, width, (4096,), seed=rows + width)
        assert_close(linear_residual(inner, weight, None, residual),
                     linear_residual_reference(inner, weight, None, residual).double(), torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("shards", [2, 4])
@pytest.mark.parametrize("rows", [4, 64, 128])
def test_stacked_sdar_8b_shards_gpu(rows, shards, assert_close):
    """A tensor-parallel rank's SDAR-8B q/k/v and gate/up stacked (`weights/packed_shards.py`), through the kernel
    and, at a batch-32 step's 128 rows, one cuBLAS GEMM each, against the three and two weights."""
    x, weights, _ = _stacked_weights("cuda", torch.bfloat16, rows, 4096, (4096 // shards, 1024 // shards,
                                                                        1024 // shards), seed=rows)
    (out,) = grouped_linear(x, [stacked(weights)], [None], max_rows=MAX_ROWS)
    assert_close(out, torch.cat(grouped_linear_reference(x, weights, [None] * 3), dim=1).double(), torch.bfloat16)
    _, (gate, up), _ = _stacked_weights("cuda", torch.bfloat16, rows, 4096, (12288 // shards,) * 2, seed=rows + 1)
    assert_close(gated_linear(x, gate, up), gated_linear_reference(x, gate, up).double(), torch.bfloat16)


@pytest.mark.parametrize("rows", [1, 7, ONE_WEIGHT_MAX_ROWS, ONE_WEIGHT_MAX_ROWS + 3])  # past 16: torch's own
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_residual_rounds_like_torch(device, poisoned, rows, dtype, with_bias, assert_close):
    """residual + x·Wᵀ + b: the projection rounded to the dtype before the add, as a decoder layer computes it."""
    x, (weight,), (bias,) = _tensors(device, dtype, rows, 300, (72,), seed=rows)
    bias = bias if with_bias else None
    residual = torch.randn(rows, 72, generator=torch.Generator().manual_seed(rows)).to(device, dtype)
    out = linear_residual(x, weight, bias, residual)
    projected = (x.double() @ weight.double().T + (0 if bias is None else bias.double())).to(dtype)
    assert out.shape == residual.shape and out.dtype == dtype
    assert_close(out, residual.double() + projected.double(), dtype)
    # a projection rounds the other way where fp32 sums straddle a midpoint; cuBLAS's one-row product with a bias
    # rounds x·Wᵀ before it adds b (a second rounding the kernel does not make)
    if dtype != torch.float32 and not (rows == 1 and bias is not None and x.is_cuda):
        assert (out != linear_residual_reference(x, weight, bias, residual)).float().mean() < 0.05
    with pytest.raises(ValueError, match=r"residual must be \[%d, 72\]" % rows):
        linear_residual(x, weight, bias, residual[:, :70])

