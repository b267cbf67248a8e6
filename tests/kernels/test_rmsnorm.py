import pytest
import torch

from hf_blockdiff.kernels.rmsnorm import add_rms_norm, add_rms_norm_reference, rms_norm, rms_norm_reference

pytest.importorskip("triton")


@pytest.mark.parametrize("shape", [(3, 5, 128), (7, 2560), (1, 64), (33, 96)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_transformers(device, poisoned, shape, dtype, assert_close):
    generator = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(shape, generator=generator) * 3).to(device, dtype)
    weight = (1 + 0.1 * torch.randn(shape[-1], generator=generator)).to(device, dtype)
    out = rms_norm(x, weight, 1e-6)
    expected = rms_norm_reference(x.double(), weight.double(), 1e-6)
    assert out.dtype == rms_norm_reference(x, weight, 1e-6).dtype and out.shape == x.shape
    assert_close(out, expected, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_add_rms_norm_matches_a_decoder_layer(device, poisoned, dtype, assert_close):
    """(x + delta, its RMSNorm): the sum exactly torch's, the norm to rounding."""
    generator = torch.Generator().manual_seed(3)
    x, delta = ((torch.randn(3, 5, 96, generator=generator) * 3).to(device, dtype) for _ in range(2))
    weight = (1 + 0.1 * torch.randn(96, generator=generator)).to(device, dtype)
    total, normed = add_rms_norm(x, delta, weight, 1e-6)
    expected_total, _ = add_rms_norm_reference(x, delta, weight, 1e-6)
    assert torch.equal(total, expected_total) and normed.shape == x.shape and normed.dtype == dtype
    assert_close(normed, rms_norm_reference(expected_total.double(), weight.double(), 1e-6), dtype)
    strided = delta.transpose(0, 1).contiguous().transpose(0, 1)  # a layout whose reshape is no plain view
    assert torch.equal(add_rms_norm(x, strided, weight, 1e-6)[0], expected_total)
    with pytest.raises(ValueError, match="delta must match x"):
        add_rms_norm(x, delta[:, :4], weight, 1e-6)


@pytest.mark.gpu
def test_rms_norm_large_gpu(assert_close):
    x = torch.randn(4096, 2560, device="cuda", dtype=torch.bfloat16)
    weight = torch.rand(2560, device="cuda", dtype=torch.bfloat16) + 0.5
    out = rms_norm(x, weight, 1e-6)
    reference = rms_norm_reference(x, weight, 1e-6)
    assert_close(out, rms_norm_reference(x.double(), weight.double(), 1e-6), torch.bfloat16)
    assert (out != reference).float().mean() < 0.01  # rounding differences on under 1 % of the elements
