"""The step's bookkeeping compiled ahead of time into a named compile cache (generation/precompiled.py): a later
process loads it instead of tracing it, for engines of other shapes too, and decodes what the eager bookkeeping
decodes; a damaged file is compiled again, and another config's artifacts never run."""

import json

import pytest
import torch
from torch._dynamo.utils import counters

from hf_blockdiff import BlockDiffusionConfig, free_cache
from hf_blockdiff.generation import engine as engine_module
from hf_blockdiff.fusion import ahead_of_time, compile_worker
from hf_blockdiff.generation import precompiled
from hf_blockdiff.generation import step as step_module
from hf_blockdiff.generation.step import PHASES, DecodeStep
from hf_blockdiff.integrations import compile_cache
from hf_blockdiff.scheduler import Scheduler

from helpers import MASK, forget_compiled_regions, left_pad, random_prompts

# per-position temperatures: the bookkeeping does float arithmetic, and reads floats of the config
CFG = dict(mask_token_id=MASK, block_size=8, max_new_tokens=16, threshold=0.6, eos_token_id=[],
           attention="block_causal", temperature=0.9, pos_temp_slope=0.7, cuda_graphs=True)
SHAPES = [(9, 4, 6, 13, 5), (30, 29, 28, 27, 26, 25, 24, 23)]  # engines of 6 and 8 slots, canvases of 32 and 48


def _decode(model, lengths, compiled, monkeypatch):
    monkeypatch.setattr(engine_module, "DecodeStep", lambda s, e, _: DecodeStep(s, e, compiled))
    ids, mask = left_pad(random_prompts(lengths, seed=len(lengths)))
    out = model.generate_multi_block(ids, BlockDiffusionConfig(**CFG), attention_mask=mask, return_dict=True,
                                     generator=torch.Generator().manual_seed(5))
    free_cache(model)
    return [out.sequences, out.logprobs, out.entropies, out.commit_step]


def _new_process():
    """What a new process has: nothing compiled in memory (the directory stays)."""
    step_module.compiled_phase.cache_clear()
    torch._dynamo.reset()
    forget_compiled_regions()


pytestmark = pytest.mark.skipif(not ahead_of_time.AVAILABLE, reason="torch before 2.11 traces the bookkeeping in each "
                                "process (generation/precompiled.py)")


@pytest.fixture
def bookkeeping_dir(tmp_path):
    ahead_of_time.use_directory(tmp_path)
    _new_process()
    yield tmp_path / "bookkeeping"  # conftest names no directory after the test
    _new_process()


def test_a_later_process_loads_the_bookkeeping_instead_of_tracing_it(qwen3, bookkeeping_dir, monkeypatch):
    """The first process runs the bookkeeping eager while the compile worker traces and saves it, then loads what the
    worker saved; a later process loads it (one damaged file traced again), and one that loads the compile cache has
    it in memory before its first call; tokens and records as eager."""
    eager = [_decode(qwen3, lengths, False, monkeypatch) for lengths in SHAPES]
    compiled = []
    trace = ahead_of_time.AheadOfTime._compile
    monkeypatch.setattr(ahead_of_time.AheadOfTime, "_compile",
                        lambda self, args, kwargs: compiled.append(self.name) or trace(self, args, kwargs))
    ahead_of_time.use_directory(bookkeeping_dir.parent, in_worker=True)
    landed = compile_worker.WORKER.landed
    frames = counters["frames"]["ok"]
    first = _decode(qwen3, SHAPES[0], True, monkeypatch)  # eager here, the worker traces it
    assert compile_worker.WORKER.settle(600)
    assert compile_worker.WORKER.landed == landed + len(PHASES)
    assert sorted(path.name.split("-")[0] for path in bookkeeping_dir.glob("*.bin")) == sorted(PHASES)
    then = _decode(qwen3, SHAPES[0], True, monkeypatch)  # what the worker saved
    assert compiled == [] and counters["frames"]["ok"] == frames  # nothing traced in this process
    for got in (first, then):
        assert all(torch.equal(a, b) for a, b in zip(got, eager[0]))

    ahead_of_time.use_directory(bookkeeping_dir.parent)
    next(bookkeeping_dir.glob("stored-*.bin")).write_bytes(b"damaged")
    _new_process()
    with pytest.warns(UserWarning, match="not loadable"):
        later = [_decode(qwen3, lengths, True, monkeypatch) for lengths in SHAPES]
    assert compiled == ["stored"]  # the damaged one; the others loaded, and both shapes ran on one variant each
    assert counters["frames"]["ok"] == frames  # no torch.compile trace either
    for got, expected in zip(later, eager):
        assert all(torch.equal(a, b) for a, b in zip(got, expected))

    # `compile_cache.save` lists the artifacts the process used, and `load` in the next process loads them: its first
    # call reads no file
    monkeypatch.setenv("TRITON_CACHE_DIR", str(bookkeeping_dir.parent / "triton"))  # `load` sets it process-wide
    compile_cache.save(qwen3, bookkeeping_dir.parent)
    _new_process()
    compile_cache.load(qwen3, bookkeeping_dir.parent, background=False)
    files = []
    load = ahead_of_time._load
    monkeypatch.setattr(ahead_of_time, "_load", lambda *args: files.append(args[1]) or load(*args))
    preloaded = _decode(qwen3, SHAPES[0], True, monkeypatch)
    assert files == [] and not ahead_of_time._PRELOADED and compiled == ["stored"]
    assert all(torch.equal(a, b) for a, b in zip(preloaded, eager[0]))
    listed = json.loads(compile_cache.used_file(qwen3, bookkeeping_dir.parent).read_text())
    assert sorted(entry["name"] for entry in listed) == sorted(PHASES)


def test_another_config_or_sampling_is_another_artifact():
    def key(**fields):
        cfg = BlockDiffusionConfig(**{**CFG, **fields})
        return precompiled.PrecompiledPhase("conclude")._key(Scheduler(cfg, 4, 32, 4, torch.device("cpu")))

    assert key() == key()
    assert len({key(), key(strategy="entropy_threshold"), key(threshold=0.7), key(pos_temp_slope=0.0)}) == 4
    scheduler = Scheduler(BlockDiffusionConfig(**CFG), 4, 32, 4, torch.device("cpu"))
    phase = precompiled.PrecompiledPhase("conclude")
    sampled = phase._key(scheduler)
    scheduler.per_row_sampling = True
    assert phase._key(scheduler) != sampled


def test_a_call_with_no_tensor_work_goes_to_torch_compile_without_a_warning(bookkeeping_dir, recwarn):
    """Bidirectional attention caches nothing, so `stored` has no op to compile: aot_compile refuses it, and the
    fallback says nothing (a warning in every process would be noise)."""
    cfg = BlockDiffusionConfig(mask_token_id=MASK, block_size=8, attention="bidirectional", max_new_tokens=16,
                               eos_token_id=[])
    scheduler = Scheduler(cfg, 2, 32, 4, torch.device("cpu"))
    phase = precompiled.PrecompiledPhase("stored")
    assert phase.variant(scheduler, scheduler.forward_layout(4).chunks) is None and phase.compiled.failed
    assert not [w for w in recwarn if "ahead of time" in str(w.message)]


def test_an_artifact_whose_inlined_code_changed_does_not_run():
    """Guards on globals are dropped: a module whose code an artifact inlined (transformers', ours) must read as when
    it was traced (an edited or upgraded install otherwise runs the old code)."""
    import inspect
    from types import SimpleNamespace

    from hf_blockdiff.scheduler import scheduler as module

    def artifact(content):
        source = SimpleNamespace(module=module.__name__, content=content)
        return SimpleNamespace(source_info=lambda: SimpleNamespace(inlined_sources=[source]))

    assert ahead_of_time._same_sources(artifact(inspect.getsource(module)))
    assert not ahead_of_time._same_sources(artifact(inspect.getsource(module) + "\n# edited\n"))
