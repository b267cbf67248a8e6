"""Compiled decoder layers in two regions around their attention (fusion/regions.py): a fused Qwen-style layer is
traced as `before_attention` and `after_attention`, whole, and nothing else of the layer, and decodes the tokens of
the same fused layers uncompiled; where a compile cache is named, a later process loads the regions instead of
tracing them (fusion/ahead_of_time.py)."""

import pytest
import torch
from torch._dynamo.utils import clear_compilation_metrics, counters, get_compilation_metrics

from hf_blockdiff import BlockDiffusionConfig, free_cache
from hf_blockdiff.fusion import ahead_of_time, compile_worker, regions
from hf_blockdiff.fusion.mode import decoder_layers, decoding_mode

from helpers import MASK, forget_compiled_regions, left_pad, random_prompts

CFG = BlockDiffusionConfig(mask_token_id=MASK, block_size=4, max_new_tokens=4, threshold=0.6, eos_token_id=[],
                           attention="block_causal", attention_backend="triton")


def _decode(model, compile_):
    ids, mask = left_pad(random_prompts((11, 6), seed=3))
    out = model.generate_multi_block(ids, CFG.replace(compile=compile_), attention_mask=mask)
    free_cache(model)
    return out


def _new_process():
    """What a new process has: nothing compiled in memory (a compile cache's directory stays)."""
    torch._dynamo.reset()
    forget_compiled_regions()


def _traced_regions(dynamic):
    """The regions under dynamo only (no inductor): what is traced, and that each traces whole (`fullgraph`, which
    the library leaves off so that an MLP breaking its graph degrades instead of failing), is what is tested."""
    return tuple(torch.compile(region, dynamic=dynamic, fullgraph=True, backend="eager")
                 for region in (regions.before_attention, regions.after_attention))


def test_fused_layers_compile_as_two_whole_regions_and_decode_the_uncompiled_tokens(qwen3, monkeypatch):
    monkeypatch.setattr(regions, "compiled_regions", _traced_regions)
    uncompiled = _decode(qwen3, False)
    torch._dynamo.reset()
    clear_compilation_metrics()
    compiled = _decode(qwen3, True)
    traced = {metrics.co_name for metrics in get_compilation_metrics()}
    torch._dynamo.reset()  # the shared regions' cache entries: none left for later tests to count
    assert {"before_attention", "after_attention"} <= traced
    assert not traced & {"forward", "rotary_in_cache_attention_forward", "_attention", "attend"}, traced
    assert torch.equal(compiled, uncompiled)


@pytest.mark.skipif(not ahead_of_time.AVAILABLE, reason="torch before 2.11 has no aot_compile: the regions are "
                    "traced in each process (fusion/ahead_of_time.py)")
def test_a_later_process_loads_the_regions_instead_of_tracing_them(qwen3, tmp_path, monkeypatch, recwarn):
    """The first process runs the regions eager while the compile worker traces them whole and saves them, then loads
    what it saved (one variant each, prefill and steps alike); a later process loads them too, before its first call
    where the last one listed them."""
    uncompiled = _decode(qwen3, False)
    ahead_of_time.use_directory(tmp_path, in_worker=True)  # conftest names no directory after the test
    compiled, trace = [], ahead_of_time.AheadOfTime._compile
    monkeypatch.setattr(ahead_of_time.AheadOfTime, "_compile",
                        lambda self, args, kwargs: compiled.append(self.name) or trace(self, args, kwargs))
    frames = counters["frames"]["ok"]
    try:
        _new_process()
        first = _decode(qwen3, True)  # eager here, traced by the worker
        assert compile_worker.WORKER.settle(600)
        assert {path.name.split("-")[0] for path in (tmp_path / "regions").glob("*.bin")} == {
            "before_attention", "after_attention"}
        then = _decode(qwen3, True)  # what the worker saved
        _new_process()
        later = _decode(qwen3, True)
        ahead_of_time.save_used(tmp_path, tmp_path / "used.json")  # `compile_cache.save`'s list
        _new_process()
        ahead_of_time.preload(tmp_path / "used.json")  # as `compile_cache.load` does: the next call reads no file
        loads, load = [], ahead_of_time._load
        monkeypatch.setattr(ahead_of_time, "_load", lambda *args: loads.append(args[1]) or load(*args))
        preloaded = _decode(qwen3, True)
    finally:
        _new_process()
    assert compiled == [] and counters["frames"]["ok"] == frames  # neither aot_compile nor torch.compile here
    assert not [w for w in recwarn if "ahead of time" in str(w.message) or "compile cache" in str(w.message)
                or "compile worker" in str(w.message)]
    assert loads == []
    for tokens in (first, then, later, preloaded):
        assert torch.equal(tokens, uncompiled)


def test_another_installed_forward_or_hook_is_another_artifact(qwen3):
    """An artifact drops its guards on the forwards set on the layer's modules and on global hooks: its key tells them
    apart, and is the same at each forward (each installs new bound methods)."""
    layer = decoder_layers(qwen3)[0]
    keys = [regions.artifact_key(layer)]
    for skinny in (False, True, True):  # the gated MLP's stock forward, then its skinny-GEMM one, twice
        with decoding_mode(qwen3, "compile", skinny=skinny):
            keys.append(regions.artifact_key(layer))
    handle = torch.nn.modules.module.register_module_forward_hook(lambda module, args, out: None)
    try:
        keys.append(regions.artifact_key(layer))
    finally:
        handle.remove()
    assert keys[2] == keys[3] and len(set(keys)) == 4
