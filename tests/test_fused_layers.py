"""Stock MLPs and attentions with skinny-GEMM projections (`fusion/layers.py`): which modules are taken,
the same outputs as the stock forwards, and the decode loop's tokens unchanged when they run."""

import warnings
from types import SimpleNamespace

import pytest
import torch
from transformers import DynamicCache

from hf_blockdiff import BlockDiffusionConfig
from hf_blockdiff.cache import paged_cache as cache
from hf_blockdiff.attention import resolve_backend
from hf_blockdiff.cache.keyword import CACHE_KEYWORD, cache_kwarg
from hf_blockdiff.fusion import layers as fused_layers
from hf_blockdiff.fusion.mode import fully_fused, fusion_for
from hf_blockdiff.fusion.layers import (
    fused_attention_forward, fused_forwards, fused_layer_forward, fused_mlp_forward,
    rotary_in_cache_attention_forward,
)
from hf_blockdiff.kernels import skinny_gemm
from hf_blockdiff.weights import packed_shards

from helpers import MASK, left_pad, random_prompts, tiny_model

pytest.importorskip("triton")


def _kinds_of(forwards):
    return sorted(type(module).__name__ for module, _ in forwards)


def _kinds(model):
    return _kinds_of(fused_forwards(model))


def test_plain_projections_are_taken_and_wrapped_ones_left():
    qwen3 = tiny_model("qwen3")
    assert _kinds(qwen3) == ["Qwen3Attention"] * 2 + ["Qwen3MLP"] * 2
    assert _kinds(tiny_model("llama")) == ["LlamaMLP"] * 2  # Llama's attention is not one of the Qwen forwards
    qwen3.model.layers[0].mlp.up_proj.register_forward_hook(lambda *args: None)  # as transformers' tensor parallel
    qwen3.model.layers[1].self_attn.k_proj.weight.data = qwen3.model.layers[1].self_attn.k_proj.weight.data.t()
    assert _kinds(qwen3) == ["Qwen3Attention", "Qwen3MLP"]  # the hooked MLP and the non-contiguous k are left
    mlp = qwen3.model.layers[1].mlp
    mlp.forward = mlp.forward  # an instance forward, as accelerate's dispatch and offload hooks set
    assert _kinds(qwen3) == ["Qwen3Attention"]
    assert _kinds(tiny_model("llama", mlp_bias=True)) == []  # gated_linear takes no gate/up bias
    attentions = fused_forwards(tiny_model("qwen3"), mlps=False)
    assert _kinds_of(attentions) == ["Qwen3Attention"] * 2
    with_layers = _kinds_of(fused_forwards(tiny_model("qwen3"), layers=True))
    assert with_layers == ["Qwen3Attention"] * 2 + ["Qwen3DecoderLayer"] * 2 + ["Qwen3MLP"] * 2
    hooked = tiny_model("qwen3")
    hooked.model.layers[0].post_attention_layernorm.register_forward_hook(lambda *args: None)
    assert _kinds_of(fused_forwards(hooked, layers=True)).count("Qwen3DecoderLayer") == 1  # its norm runs itself


@pytest.mark.parametrize("family", ["qwen3", "qwen2"])  # Qwen2: biased q/k/v, no q/k norms
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [5, 20])  # 10 rows: every projection fused; 40: o and down by cuBLAS
def test_fused_forwards_equal_the_stock_ones(family, dtype, tokens):
    model = tiny_model(family).to(dtype)
    layer = model.model.layers[0]
    hidden = torch.randn(2, tokens, 64, generator=torch.Generator().manual_seed(1)).to(dtype)
    positions = torch.arange(tokens)[None].expand(2, -1)
    rotary = model.model.rotary_emb(hidden, positions)
    tolerance = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(fused_mlp_forward(layer.mlp, hidden), layer.mlp(hidden), **tolerance)
    stock, _ = layer.self_attn(hidden, rotary, None)
    for forward in (fused_attention_forward, rotary_in_cache_attention_forward):  # the stock steps outside decoding
        fused, _ = forward(layer.self_attn, hidden, rotary, None)
        torch.testing.assert_close(fused, stock, **tolerance)
    stock_layer = layer(hidden, position_embeddings=rotary).float()  # the MLP output reaches ~300 here: 1 bf16 ulp
    error = (fused_layer_forward(layer, hidden, position_embeddings=rotary).float() - stock_layer).norm()
    assert error / stock_layer.norm() < (1e-5 if dtype == torch.float32 else 1e-2)  # of a norm propagates to 2.0
    assert fused.abs().max() > 0.1  # not a vanishing output that any kernel would match


def _stack(modules, names) -> None:
    """Each module's projections `names` (weights and biases) moved side by side into one buffer, as `pack_shards`
    moves a sharded model's local shards (the parameters stay the objects they are)."""
    for module in modules:
        for key in ("weight", "bias"):
            params = [getattr(getattr(module, name), key) for name in names]
            if params[0] is not None:
                views = torch.cat([p.detach() for p in params]).split([p.shape[0] for p in params])
                for param, view in zip(params, views):
                    torch.utils.swap_tensors(param, torch.nn.Parameter(view, requires_grad=False))


def _as_parameters(views: dict) -> dict:
    """The stacked views as the call gives them to their module (`tensor_parallel.sharded_decoding`)."""
    return {name: torch.nn.Parameter(view, requires_grad=False) for name, view in views.items()}


@pytest.mark.parametrize("family", ["qwen3", "qwen2"])  # Qwen2: biased q/k/v
@pytest.mark.parametrize("tokens", [5, 40])  # 10 rows: the kernel over one weight; 80: one cuBLAS GEMM
def test_stacked_qkv_projects_as_the_three_weights(family, tokens, monkeypatch):
    """An attention given its q/k/v as one stacked weight (`weights/packed_shards.py`, a sharded model's call) gives
    the q, k and v of the three weights, in one projection of one weight; only weights lying side by side are
    stacked."""
    weights, project = [], fused_layers.grouped_linear
    monkeypatch.setattr(fused_layers, "grouped_linear", lambda x, w, *args, **kwargs: weights.append(len(w)) or project(
        x, w, *args, **kwargs))
    model = tiny_model(family)
    assert packed_shards.stacked_projections(model) == []
    hidden = torch.randn(2, tokens, 64, generator=torch.Generator().manual_seed(3))
    rotary = model.model.rotary_emb(hidden, torch.arange(tokens)[None].expand(2, -1))
    attention = model.model.layers[0].self_attn
    three = fused_layers.query_key_value(attention, hidden, rotary, True)
    _stack([layer.self_attn for layer in model.model.layers], packed_shards.QKV)
    found = packed_shards.stacked_projections(model)
    assert [module for module, _ in found] == [layer.self_attn for layer in model.model.layers]
    assert all(sorted(params) == sorted([packed_shards.STACKED_QKV] + [packed_shards.STACKED_QKV_BIAS] * (
        family == "qwen2")) for _, params in found)
    attention._parameters.update(_as_parameters(found[0][1]))
    one = fused_layers.query_key_value(attention, hidden, rotary, True)
    assert weights == [3, 1]
    for stacked_out, out in zip(one[:3], three[:3]):
        torch.testing.assert_close(stacked_out, out, atol=1e-5, rtol=1e-5)
    assert one[0].abs().max() > 0.1


def test_stacked_gate_up_is_one_gemm_in_wide_forwards(monkeypatch):
    """An MLP given its gate and up stacked runs them as one GEMM where the skinny ops are not installed (forwards of
    more rows than the kernel takes), with the stock MLP's output."""
    model = tiny_model("qwen3")
    hidden = torch.randn(2, 40, 64, generator=torch.Generator().manual_seed(4))
    mlps = [layer.mlp for layer in model.model.layers]
    stock = mlps[0](hidden)
    _stack(mlps, packed_shards.GATE_UP)
    found = packed_shards.stacked_projections(model)
    assert [(module, list(params)) for module, params in found] == [(m, [packed_shards.STACKED_GATE_UP]) for m in mlps]
    for module, params in found:
        module._parameters.update(_as_parameters(params))
    forwards = dict(fused_forwards(model, mlps=False))
    assert all(forwards[m].__func__ is fused_layers.stacked_mlp_forward for m in mlps)
    shapes, linear = [], torch.nn.functional.linear
    monkeypatch.setattr(torch.nn.functional, "linear", lambda x, w, *args: shapes.append(tuple(w.shape)) or linear(
        x, w, *args))
    torch.testing.assert_close(forwards[mlps[0]](hidden), stock, atol=1e-5, rtol=1e-5)
    assert shapes == [(2 * mlps[0].gate_proj.out_features, 64), (64, mlps[0].gate_proj.out_features)]


def test_decoding_restores_a_forward_set_on_a_norm():
    """A forward set on a norm's instance before the call (transformers' tensor-parallel one on a replicated q/k norm)
    is the norm's forward again after it, though the call ran the fused norm in its place."""
    model = tiny_model("qwen3")
    norm = model.model.layers[0].self_attn.q_norm
    norm.forward = own = type(norm).forward.__get__(norm)
    ids, mask = left_pad(random_prompts((9, 4), seed=2))
    config = BlockDiffusionConfig(mask_token_id=MASK, block_size=4, max_new_tokens=4, eos_token_id=[],
                                  attention="block_causal", attention_backend="triton")
    model.generate_multi_block(ids, config, attention_mask=mask)
    assert vars(norm)["forward"] is own


@pytest.mark.parametrize("keyword", ["past_key_values", CACHE_KEYWORD])
def test_fused_forwards_with_a_cache_run_the_stock_ones(keyword):
    """Given a KV cache under either keyword (transformers 5.24 passes `cache`, earlier ones `past_key_values`), the
    fused layer and attention forwards run the stock ones, which fill it; without one, they pass none on, so that
    nothing warns about the renamed keyword."""
    model = tiny_model("qwen3")
    layer = model.model.layers[0]
    hidden = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(3))
    rotary = model.model.rotary_emb(hidden, torch.arange(5)[None].expand(2, -1))
    stock_cache, fused_cache, attention_cache = DynamicCache(), DynamicCache(), DynamicCache()
    stock = layer(hidden, position_embeddings=rotary, **cache_kwarg(stock_cache))
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*past_key_values", category=FutureWarning)
        fused = fused_layer_forward(layer, hidden, position_embeddings=rotary, **{keyword: fused_cache})
        fused_attention_forward(layer.self_attn, hidden, rotary, None, **{keyword: attention_cache})
        fused_layer_forward(layer, hidden, position_embeddings=rotary)
    torch.testing.assert_close(fused, stock, atol=0, rtol=0)  # the same stock code
    assert stock_cache.get_seq_length() == fused_cache.get_seq_length() == attention_cache.get_seq_length() == 5


def _counted(calls, name, kernel):
    def run(*args, **kwargs):
        calls[name] += 1
        return kernel(*args, **kwargs)
    return run


@pytest.mark.parametrize("family", ["qwen3", "qwen2"])  # Qwen2: no q/k norms, biased q/k/v
def test_decoding_runs_them_and_keeps_the_tokens(family, monkeypatch):
    """The Triton backend installs the fused forwards (denoising forwards of 12 tokens here: the Triton kernel), whose
    q/k norms and rotary embedding run in the cache's write kernel; tokens equal the sdpa backend's, which fuses
    nothing; the model's own forwards are back after the call."""
    model = tiny_model(family)
    calls = {"grouped": 0, "gated": 0, "kernel": 0, "rotary": 0, "residual": 0, "add_norm": 0}
    for name, op in (("grouped", "grouped_linear"), ("gated", "gated_linear"), ("residual", "linear_residual"),
                     ("add_norm", "add_rms_norm")):
        monkeypatch.setattr(fused_layers, op, _counted(calls, name, getattr(fused_layers, op)))
    monkeypatch.setattr(skinny_gemm, "_launch", _counted(calls, "kernel", skinny_gemm._launch))
    monkeypatch.setattr(cache, "rotary_write", _counted(calls, "rotary", cache.rotary_write))
    ids, mask = left_pad(random_prompts((9, 4, 6), seed=5))
    config = BlockDiffusionConfig(mask_token_id=MASK, block_size=4, max_new_tokens=8, threshold=0.6, eos_token_id=[],
                                  attention="block_causal", alignment="absolute")
    plain, fused = (model.generate_multi_block(ids, config.replace(attention_backend=backend), attention_mask=mask)
                    for backend in ("sdpa", "triton"))
    assert torch.equal(plain, fused)
    # the ops in every forward (the prefill's rows go to cuBLAS inside them), the Triton kernel in the denoising ones;
    # the decoder layers (not compiled: fusion "norms") add their residuals in the down projection and the norm
    assert calls["gated"] > 0 and calls["grouped"] == 2 * calls["gated"] and calls["kernel"] >= 4 * 2 * 6
    assert calls["rotary"] == calls["residual"] == calls["add_norm"] == calls["gated"]
    assert all("forward" not in vars(m) for m in model.modules())


def test_many_tokens_keep_the_stock_mlps(monkeypatch):
    """Denoising forwards of more tokens than the skinny kernel takes (3 rows of 2 blocks of 16): the attentions still
    write through the rotary kernel, the MLPs run as they are (compiled, they fuse their activation)."""
    model = tiny_model("qwen3")
    calls = {"gated": 0, "rotary": 0}
    monkeypatch.setattr(fused_layers, "gated_linear", _counted(calls, "gated", fused_layers.gated_linear))
    monkeypatch.setattr(cache, "rotary_write", _counted(calls, "rotary", cache.rotary_write))
    ids, mask = left_pad(random_prompts((9, 4, 6), seed=7))
    config = BlockDiffusionConfig(mask_token_id=MASK, block_size=16, max_new_tokens=16, threshold=0.6,
                                  eos_token_id=[], attention="block_causal", alignment="absolute")
    plain, fused = (model.generate_multi_block(ids, config.replace(attention_backend=backend), attention_mask=mask)
                    for backend in ("sdpa", "triton"))
    assert torch.equal(plain, fused)
    assert calls["gated"] == 0 and calls["rotary"] > 0


def test_hooked_qk_norms_run_as_they_are(monkeypatch):
    """A q/k norm that is not exactly transformers' stock one (here hooked) runs itself, before the stock write."""
    model = tiny_model("qwen3")
    seen = []
    model.model.layers[1].self_attn.q_norm.register_forward_hook(lambda module, args, out: seen.append(out.shape))
    monkeypatch.setattr(cache, "rotary_write", _counted(calls := {"rotary": 0}, "rotary", cache.rotary_write))
    ids, mask = left_pad(random_prompts((9, 4), seed=2))
    config = BlockDiffusionConfig(mask_token_id=MASK, block_size=4, max_new_tokens=8, threshold=0.6, eos_token_id=[],
                                  attention="block_causal", alignment="absolute")
    plain, fused = (model.generate_multi_block(ids, config.replace(attention_backend=backend), attention_mask=mask)
                    for backend in ("sdpa", "triton"))
    assert torch.equal(plain, fused)
    forwards = calls["rotary"]  # layer 0 writes through the kernel, layer 1 runs its hooked norm in every forward
    assert forwards > 0 and len(seen) == 2 * forwards  # the sdpa call's forwards, then the triton call's


@pytest.mark.gpu
@pytest.mark.parametrize("compile_", [False, True])
def test_cuda_graph_steps_keep_the_tokens_gpu(compile_, monkeypatch):
    """On the GPU (CUDA graphs, compiled layers or not): the tokens of the same steps with the fusion removed."""
    model = tiny_model("qwen3").cuda()
    ids, mask = left_pad(random_prompts((9, 4, 6), seed=6))
    config = BlockDiffusionConfig(mask_token_id=MASK, block_size=4, max_new_tokens=16, threshold=0.6,
                                  eos_token_id=[], attention="block_causal", alignment="absolute", compile=compile_)
    fused = model.generate_multi_block(ids.cuda(), config, attention_mask=mask.cuda())
    monkeypatch.setattr("hf_blockdiff.fusion.mode.fused_forwards", lambda model, **kinds: [])
    assert torch.equal(fused, model.generate_multi_block(ids.cuda(), config, attention_mask=mask.cuda()))


def test_compile_is_off_by_default_where_every_layer_runs_fused():
    """compile=None: no torch.compile where every decoder layer runs fused at few tokens beside fused norms on one GPU
    (it would only cost its first-call time, docs/benchmarks.md, "Cold start"); compiled with many tokens, layers left
    unfused, a backend that fuses no norms, or tensor parallel."""
    cuda, config = torch.device("cuda"), BlockDiffusionConfig(mask_token_id=MASK, block_size=4, max_new_tokens=8)
    triton_backend, flash = resolve_backend("triton", cuda, 4, 64), SimpleNamespace(fuses_norms=False,
                                                                                    batch_invariant=False)
    qwen3 = tiny_model("qwen3")
    assert fully_fused(qwen3) and not fully_fused(tiny_model("llama"))  # Llama's attention is not fused
    assert fusion_for(config, triton_backend, True, cuda, qwen3, 8) == "norms"  # 8 rows x 2 blocks x 4 = 64 tokens
    assert fusion_for(config, triton_backend, True, cuda, qwen3, 9) == "compile"
    assert fusion_for(config, triton_backend, True, cuda, tiny_model("llama"), 1) == "compile"
    assert fusion_for(config, flash, True, cuda, qwen3, 1) == "compile"
    assert fusion_for(config.replace(compile=True), triton_backend, True, cuda, qwen3, 1) == "compile"
    assert fusion_for(config.replace(cfg_scale=1.0), triton_backend, True, cuda, qwen3, 8) == "compile"  # guided: x2
    invariant = resolve_backend("triton", cuda, 4, 64, batch_invariant=True)  # batch_invariant: never compiled
    assert fusion_for(config.replace(batch_invariant=True), invariant, True, cuda, qwen3, 9) == "norms"
    with pytest.MonkeyPatch.context() as patch:  # tensor parallel: compiled at few tokens too
        patch.setattr("hf_blockdiff.fusion.mode.tensor_parallel_size", lambda model: 2)
        assert fusion_for(config, triton_backend, True, cuda, qwen3, 1) == "compile"
    qwen3.model.layers[1].input_layernorm.register_forward_hook(lambda *args: None)  # a layer left to run itself
    assert not fully_fused(qwen3) and fusion_for(config, triton_backend, True, cuda, qwen3, 1) == "compile"
