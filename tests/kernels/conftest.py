import pytest
import torch

TOLERANCE = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 1e-2}


@pytest.fixture
def device():
    return "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def poisoned(monkeypatch):
    """Make every torch.empty, torch.empty_like and Tensor.new_empty during the test return NaN (floats) or -7
    (integers), so unwritten outputs show."""

    def poisoning(allocate):
        def poisoned_allocation(*args, **kwargs):
            t = allocate(*args, **kwargs)
            return t.fill_(float("nan") if t.is_floating_point() else -7)

        return poisoned_allocation

    monkeypatch.setattr(torch, "empty", poisoning(torch.empty))
    monkeypatch.setattr(torch, "empty_like", poisoning(torch.empty_like))
    monkeypatch.setattr(torch.Tensor, "new_empty", poisoning(torch.Tensor.new_empty))


@pytest.fixture
def assert_close():
    """Relative error ||out - ref|| / ||ref|| within the tolerance of `dtype`, against an fp64 reference."""

    def check(out, ref, dtype):
        assert not out.isnan().any(), "NaN in output"
        err = (out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)
        assert err <= TOLERANCE[dtype], f"relative error {err:.3g} > {TOLERANCE[dtype]} for {dtype}"

    return check
