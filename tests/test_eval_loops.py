"""Eval loops start fast (docs/architecture.md, "The cache"): engines come in a few slot counts and canvas widths, so
calls of other prompt lengths and batch sizes reuse one, and the compiled bookkeeping traces its sizes as symbols,
so an engine of another shape compiles nothing."""

import torch
from torch._dynamo.utils import counters

from hf_blockdiff import BlockDiffusionConfig, free_cache
from hf_blockdiff.generation import engine as engine_module
from hf_blockdiff.generation.engine import shape_bucket
from hf_blockdiff.generation.step import DecodeStep
from hf_blockdiff.tools.measure import recompile_limits_hit

from helpers import MASK, left_pad, random_prompts

CFG = dict(mask_token_id=MASK, block_size=4, max_new_tokens=8, eos_token_id=[], attention="block_causal",
           temperature=0.8)


def test_shape_buckets_are_few_and_at_most_half_again_as_large():
    sizes = range(1, 5000)
    assert all(size <= shape_bucket(size) <= max(size, 1.5 * size) for size in sizes)
    assert len({shape_bucket(size) for size in sizes}) == 25  # 1, 2, 3, 4, 6, 8, 12, ..., 4096, 6144
    assert [shape_bucket(n) for n in (1, 5, 7, 33, 456, 513, 640)] == [1, 6, 8, 48, 512, 768, 768]


def _call(model, lengths, seed, **fields):
    ids, mask = left_pad(random_prompts(lengths, seed=seed))
    cfg = BlockDiffusionConfig(**CFG, **fields)
    return model.generate_multi_block(ids, cfg, attention_mask=mask, generator=torch.Generator().manual_seed(seed))


def test_calls_of_other_lengths_and_batch_sizes_reuse_the_engine_of_their_bucket(qwen3):
    free_cache(qwen3)
    _call(qwen3, (20, 9, 14, 17, 5), seed=1)  # 5 prompts: 6 slots; 20 + 8 new tokens: a canvas of 32
    engine = qwen3._blockdiff_engine
    assert (engine.state.num_rows, engine.state.width) == (6, 32)
    for lengths in [(11, 3, 7, 19, 8, 4), (21, 6, 2, 13, 10)]:  # 6 and 5 prompts, narrower canvases
        reused = _call(qwen3, lengths, seed=2)
        assert qwen3._blockdiff_engine is engine
        free_cache(qwen3)
        assert torch.equal(_call(qwen3, lengths, seed=2), reused)  # a fresh engine's tokens
        _call(qwen3, (20, 9, 14, 17, 5), seed=1)
        engine = qwen3._blockdiff_engine


def _compiled_step(scheduler, executor, _):
    return DecodeStep(scheduler, executor, True)


def test_compiled_bookkeeping_compiles_nothing_after_the_first_call(qwen3, monkeypatch):
    """Eight shapes, batch sizes 2 to 8 (a size-1 dimension would specialize: one compile more for single prompts),
    the step's bookkeeping forced through torch.compile as on CUDA: every compile happens in the first call."""
    free_cache(qwen3)
    torch._dynamo.reset()  # what earlier tests compiled: this one counts its own first call's compiles
    monkeypatch.setattr(engine_module, "DecodeStep", _compiled_step)
    shapes = [(4, 16), (4, 40), (8, 16), (2, 100), (6, 30), (3, 60), (8, 80), (5, 9)]
    with recompile_limits_hit() as hits:
        frames = []
        for index, (batch, longest) in enumerate(shapes):
            before = counters["frames"]["ok"]
            _call(qwen3, [longest - row for row in range(batch)], seed=index, cuda_graphs=True)
            frames.append(counters["frames"]["ok"] - before)
    free_cache(qwen3)
    assert frames[0] > 0 and frames[1:] == [0] * 7, frames
    assert hits == []


def _traced(function, dynamic):
    """torch.compile under dynamo only (no inductor): what is traced, and when, is what a test of recompiles counts."""
    compiled = torch.compile(function, dynamic=dynamic, backend="eager")

    def traced(*args, **kwargs):
        with torch.fx.experimental._config.patch(use_duck_shape=False):
            return compiled(*args, **kwargs)
    return traced


def test_a_single_prompt_after_a_batch_compiles_nothing(qwen3, monkeypatch):
    """A lone prompt's prefill and steps would be forwards of one chunk and bookkeeping of one slot, which torch.compile
    traces apart from larger sizes: forwards hold at least two chunks and such an engine two slots, so a call of one
    prompt after one of three copies of a prompt (which decode alike: never one row left) compiles nothing."""
    from hf_blockdiff.fusion import mode
    from hf_blockdiff.generation import step

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the stock layers: interpreted kernels take seconds a step
    free_cache(qwen3)
    torch._dynamo.reset()
    monkeypatch.setattr(mode, "compiled_forward", lambda layer_type, dynamic: _traced(layer_type.forward, dynamic))
    monkeypatch.setattr(step, "compiled_phase", lambda name: _traced(getattr(step.Scheduler, name), True))
    monkeypatch.setattr(engine_module, "DecodeStep", _compiled_step)
    cfg = BlockDiffusionConfig(**(CFG | dict(temperature=0.0)), compile=True, cuda_graphs=True)  # steps as on CUDA
    frames = []
    for ids in random_prompts([12], seed=0)[0].repeat(3, 1), random_prompts([5], seed=1)[0][None]:
        before = counters["frames"]["ok"]
        qwen3.generate_multi_block(ids, cfg)
        frames.append(counters["frames"]["ok"] - before)
    assert qwen3._blockdiff_engine.state.num_rows == 2
    free_cache(qwen3)
    assert frames[0] > 0 and frames[1] == 0, frames


def test_compiled_layers_give_every_size_its_own_symbol(qwen3):
    """Inside `decoding_mode` with compiled layers, sizes that happen to be equal are not tied into one symbol (duck
    sizing): DiffusionGemma's compiled layers, first called with as many slots as heads, recompiled for a batch of
    another bucket. Here two inputs of 4 rows each, then 8 and 4: one graph."""
    from hf_blockdiff.fusion.mode import decoding_mode

    torch._dynamo.reset()
    compiled = torch.compile(lambda x, y: x.sum(0) + y.sum(0), dynamic=True, backend="eager", fullgraph=True)
    before = counters["stats"]["unique_graphs"]
    with decoding_mode(qwen3, "compile"):
        for rows in (4, 8):
            compiled(torch.ones(rows, 3), torch.ones(4, 3))
    assert counters["stats"]["unique_graphs"] - before == 1


def _eval_loop_bench():
    """benchmarks/eval_loop.py as a module (the benchmarks are scripts, not a package)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parent.parent / "benchmarks" / "eval_loop.py"
    spec = importlib.util.spec_from_file_location("eval_loop", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_eval_loop_bench_runs_a_dense_an_moe_and_a_diffusion_gemma_family_on_cpu(monkeypatch, capsys):
    """The bench's CPU path, tiny shapes, two calls of other batch sizes, widths and new tokens per family: a row per
    call and the rule's verdict per family (nothing compiles on the CPU)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the kernels' torch twins: the bench is under test here
    rows = _eval_loop_bench().main(["--device", "cpu", "--calls", "2", "--batch-sizes", "3,2", "--new-tokens", "4,8",
                                    "--min-prompt", "4", "--max-prompt", "12", "--denoising-steps", "2"])
    families = ["tiny", "llada2-tiny", "diffusion-gemma-tiny"]
    assert [(row["family"], row["call"], row["batch"], row["new_tokens"]) for row in rows] == [
        (family, call, batch, new) for family in families for call, batch, new in ((1, 3, 4), (2, 2, 8))]
    assert all(row["frames"] == row["graphs"] == 0 and row["recompiles"] == [] for row in rows)
    out = capsys.readouterr().out
    assert out.count("no frame after call 1): ok") == 3 and "| 2 | 2 |" in out


def test_eval_loop_bench_reports_recompiles_and_breaks_of_the_rule():
    """What the bench watches: a recompile's frame and reason; the rule fails on a frame after the first call and on
    a call over twice the steady state."""
    bench = _eval_loop_bench()
    torch._dynamo.reset()
    compiled = torch.compile(lambda x: x * 2, dynamic=False, backend="eager")
    with bench.watching() as since:
        compiled(torch.ones(3))
        assert since()[:2] == (1, [])
        compiled(torch.ones(5))
        frames, reasons, graphs = since()
    assert frames == 1 and len(reasons) == 1 and "size mismatch" in reasons[0] and graphs == 0
    row = dict(family="f", frames=0, seconds=1.0)
    assert bench.verdict([row, row, row])["rule"] == "ok"
    assert bench.verdict([row, row | dict(frames=1), row])["rule"] == "FAIL"
    assert bench.verdict([row, row | dict(seconds=2.5), row, row])["rule"] == "FAIL"


def test_a_later_process_compiles_the_layers_dynamic_at_once(qwen3, monkeypatch, tmp_path):
    """Dynamo's profile of the dimensions that turned dynamic (kept under the model's `profile_job` in inductor's
    cache directory): the first process's layers compile static at the prefill and again, the token dimension dynamic,
    at the first step; a later process (here: dynamo reset, the profile read back from the directory) compiles each
    frame once. The portable artifacts carry the profile."""
    from hf_blockdiff.fusion import mode

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the stock layers: interpreted kernels take seconds a step
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # where dynamo keeps the profile
    monkeypatch.setattr(mode, "compiled_forward", lambda layer_type, dynamic: _traced(layer_type.forward, dynamic))
    cfg = BlockDiffusionConfig(**(CFG | dict(temperature=0.0)), compile=True)
    ids, mask = left_pad(random_prompts([12, 9, 7], seed=0))
    frames = []
    for _ in range(2):
        free_cache(qwen3)
        torch._dynamo.reset()  # a fresh process: no compiled code, the profile read again
        before = counters["frames"]["ok"]
        qwen3.generate_multi_block(ids, cfg, attention_mask=mask)
        frames.append(counters["frames"]["ok"] - before)
    free_cache(qwen3)
    assert list((tmp_path / "dynamo").glob(f"code_state_{mode.profile_job(qwen3)}*")), list(tmp_path.rglob("*"))
    assert frames[1] < frames[0], frames
    saved = torch.compiler.save_cache_artifacts()  # what `hf-blockdiff warmup` saves carries the profile too
    assert saved is not None and any(key.startswith(mode.profile_job(qwen3)) for key in saved[1].pgo_artifacts)
