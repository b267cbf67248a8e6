"""The scheduler's share of a step through torch.compile (generation/step.py, `compiled_bookkeeping`): the engine
turns it on beside compiled layers on CUDA; here it is forced on CPU, where CUDA-graph steps run eagerly at the same
fixed shapes, and must compile whole (no graph break, no fallback) and give the eager scheduler's tokens, step counts
and per-token records."""

import pytest
import torch
from torch._dynamo.utils import clear_compilation_metrics, counters, get_compilation_metrics

from hf_blockdiff import BlockDiffusionConfig, free_cache
from hf_blockdiff.fusion.compiling import compile_settings
from hf_blockdiff.generation import engine as engine_module
from hf_blockdiff.generation.step import PHASES, DecodeStep, compiled_phase
from hf_blockdiff.scheduler import Scheduler
from hf_blockdiff.tools.measure import recompile_limits_hit

from helpers import MASK, left_pad, random_prompts

MODES = {  # several active blocks and an entropy-scored strategy; sampling, per-position temperatures, a strategy
    # with a float threshold of its own (dynamic_pmax's log threshold)
    "multi_block": dict(attention="block_causal", alignment="prompt_end", logit_shift=True, max_active_blocks=3,
                        block_add_threshold=0.5, decoded_token_threshold=0.5, strategy="entropy_threshold",
                        threshold=1.0),
    "sampled": dict(attention="block_causal", alignment="absolute", temperature=0.9, pos_temp_slope=0.5,
                    strategy="dynamic_pmax", threshold=0.3),
}


def _compiled_step(scheduler, executor, _):
    return DecodeStep(scheduler, executor, True)


@pytest.mark.parametrize("mode", sorted(MODES))
def test_compiled_bookkeeping_keeps_every_token(qwen3, mode, monkeypatch):
    ids, mask = left_pad(random_prompts((9, 4, 6), seed=14))
    cfg = BlockDiffusionConfig(mask_token_id=MASK, block_size=4, max_new_tokens=12, eos_token_id=[],
                               cuda_graphs=True, **MODES[mode])

    def run():
        generator = torch.Generator().manual_seed(3)
        return qwen3.generate_multi_block(ids, cfg, attention_mask=mask, generator=generator, return_dict=True)

    eager = run()
    free_cache(qwen3)  # the next call builds its engine, with the compiled scheduler calls
    monkeypatch.setattr(engine_module, "DecodeStep", _compiled_step)
    counters.clear()
    with recompile_limits_hit() as hits:
        compiled = run()
    step = qwen3._blockdiff_engine.decode_step
    free_cache(qwen3)
    assert [getattr(step, name).__func__ for name in PHASES] == [compiled_phase(name) for name in PHASES]
    assert counters["stats"]["unique_graphs"] >= len(PHASES) and not counters["graph_break"]
    assert hits == []
    assert torch.equal(eager.sequences, compiled.sequences)
    assert eager.num_forwards == compiled.num_forwards
    for record in ("logprobs", "entropies", "commit_step"):
        assert torch.equal(getattr(eager, record), getattr(compiled, record)), record


def _aot_eager_step(scheduler, executor, _):
    """A step whose scheduler calls are traced as `compiled_phase` traces them, through AOTAutograd on every trace
    (inductor's cache would skip it when warm, and with it the specializations that make dynamo trace again)."""
    step = DecodeStep(scheduler, executor, False)
    for name in PHASES:
        compiled = torch.compile(getattr(Scheduler, name), dynamic=True, backend="aot_eager")

        def phase(*args, compiled=compiled, **kwargs):
            with compile_settings():
                return compiled(scheduler, *args, **kwargs)
        setattr(step, name, phase)
    return step


def test_each_scheduler_call_is_traced_once(qwen3, monkeypatch):
    """The config's floats are symbols to dynamo; a Python branch on one would be specialized after the trace, and
    dynamo would trace the whole call again (seconds of a cold first call: docs/kernels.md, "Kernels and backends")."""
    ids, mask = left_pad(random_prompts((9, 4, 6), seed=14))
    cfg = BlockDiffusionConfig(mask_token_id=MASK, block_size=4, max_new_tokens=8, eos_token_id=[], cuda_graphs=True,
                               **MODES["multi_block"])
    free_cache(qwen3)
    torch._dynamo.reset()
    clear_compilation_metrics()
    monkeypatch.setattr(engine_module, "DecodeStep", _aot_eager_step)
    qwen3.generate_multi_block(ids, cfg, attention_mask=mask)
    free_cache(qwen3)
    traced = {m.co_name: m.restart_reasons for m in get_compilation_metrics() if m.co_name in PHASES}
    assert sorted(traced) == sorted(PHASES)
    assert all(not reasons for reasons in traced.values()), traced
