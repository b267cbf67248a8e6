"""MoE families (SDAR-MoE, LLaDA2): experts run as transformers' grouped GEMMs, and a checkpoint with a missing or
mis-shaped expert tensor is refused with an error naming that tensor (model_patches/experts.py)."""

from __future__ import annotations

import pytest
import torch
from released_checkpoints import llada2_config, random_state, sdar_moe_config, write_checkpoint
from transformers import AutoModelForCausalLM

FAMILIES = {"sdar_moe": sdar_moe_config, "llada2": llada2_config}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def released(request, tmp_path_factory):
    config = FAMILIES[request.param]()
    return config, random_state(config)


def test_experts_run_grouped_and_match_the_eager_loop(released, tmp_path):
    config, state = released
    model = AutoModelForCausalLM.from_pretrained(write_checkpoint(tmp_path, config, state), dtype=torch.float32)
    assert model.config._experts_implementation == "grouped_mm"  # transformers' fallback for unknown classes: eager
    ids = torch.randint(0, 90, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        grouped = model(ids).logits
        model.set_experts_implementation("eager")
        eager = model(ids).logits
    torch.testing.assert_close(grouped, eager, atol=1e-5, rtol=1e-5)


def _expert_tensor(state):
    layer = max(int(name.split(".")[2]) for name in state if ".experts." in name)
    return f"model.layers.{layer}.mlp.experts.1.down_proj.weight"


def test_missing_expert_tensor_is_named(released, tmp_path):
    config, state = released
    name = _expert_tensor(state)
    broken = {key: value for key, value in state.items() if key != name}
    with pytest.raises(ValueError, match=rf"no expert tensor `{name}`"):
        AutoModelForCausalLM.from_pretrained(write_checkpoint(tmp_path, config, broken))


def test_mis_shaped_expert_tensor_is_named(released, tmp_path):
    config, state = released
    name = _expert_tensor(state)
    broken = {**state, name: state[name][:, :-1].clone()}
    with pytest.raises(ValueError, match=rf"holds `{name}` with shape"):
        AutoModelForCausalLM.from_pretrained(write_checkpoint(tmp_path, config, broken))
