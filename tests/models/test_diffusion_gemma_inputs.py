"""DiffusionGemma: bad input refused before any forward with the model unchanged, the preset, the counter noise's
distributions, and (GPU) the captured fast path against the eager one."""

from __future__ import annotations

import pytest
import torch

from diffusion_gemma_models import CANVAS, VOCAB, prompts, settings, tiny_diffusion_gemma

from hf_blockdiff import BlockDiffusionConfig
from hf_blockdiff.kernels.rng import uniform_tokens
from hf_blockdiff.canvas.schedule import CanvasRules, CounterNoise


@pytest.fixture(scope="module")
def model():
    return tiny_diffusion_gemma("mixed_moe")


def forwards_counted(model):
    calls = []
    handles = [module.register_forward_hook(lambda *_: calls.append(1))
               for module in (model.model.encoder.language_model.layers[0], model.model.decoder.layers[0])]
    return calls, handles


@pytest.mark.parametrize("make_config,field", [
    (lambda: BlockDiffusionConfig(entropy_bound=-0.1), "entropy_bound"),
    (lambda: BlockDiffusionConfig(t_max=0.3, t_min=0.5), "t_min"),
    (lambda: BlockDiffusionConfig(max_denoising_steps=0), "max_denoising_steps"),
    (lambda: BlockDiffusionConfig(stop_stability=-1), "stop_stability"),
    (lambda: BlockDiffusionConfig(noise="philox"), "noise"),
])
def test_invalid_canvas_settings_name_the_field(make_config, field):
    with pytest.raises(ValueError, match=field):
        make_config()


@pytest.mark.parametrize("call,match", [
    (lambda m, ids: m.generate_multi_block(ids, BlockDiffusionConfig.from_preset("sdar")), "preset"),
    (lambda m, ids: m.generate_multi_block(ids, BlockDiffusionConfig(strategy="entropy_bounded")), "strategy"),
    (lambda m, ids: m.generate_multi_block(ids, pixel_values=torch.zeros(1, 3, 8, 8)), "image"),
    (lambda m, ids: m.generate_multi_block(torch.cat([ids, torch.tensor([[VOCAB + 10]])], 1)), "image"),
    (lambda m, ids: m.generate_multi_block(ids, BlockDiffusionConfig(attention_backend="flash_attn")), "triton"),
    (lambda m, ids: m.generate_multi_block(ids, BlockDiffusionConfig(noise="torch", cuda_graphs=True)), "noise"),
    (lambda m, ids: m.generate_multi_block(ids, BlockDiffusionConfig(max_new_tokens=1024)), "max_position"),
    (lambda m, ids: m.generate_multi_block(ids, BlockDiffusionConfig(prefix_cache_tokens=64)),
     "runtime.prefix_cache_tokens=64 is invalid: DiffusionGemma decodes every prompt"),
    (lambda m, ids: m.generate_multi_block(ids, BlockDiffusionConfig(max_batch_size=1)), "runtime.max_batch_size"),
])
def test_bad_input_before_any_forward_model_unchanged(model, call, match):
    ids, _ = prompts([6])
    before = {k: v.clone() for k, v in model.state_dict().items()}
    calls, handles = forwards_counted(model)
    try:
        with pytest.raises(ValueError, match=match):
            call(model, ids)
    finally:
        for handle in handles:
            handle.remove()
    assert calls == [] and not model.training
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert model.config._attn_implementation != "hf_blockdiff"


def test_canvas_length_that_does_not_fit(model):
    ids, _ = prompts([6])
    model.config.canvas_length = 0
    try:
        with pytest.raises(ValueError, match="canvas_length"):
            model.generate_multi_block(ids)
    finally:
        model.config.canvas_length = CANVAS


def test_diffusion_gemma_preset_refused_on_another_family(qwen3):
    with pytest.raises(ValueError, match="preset"):
        qwen3.generate_multi_block(torch.tensor([[1, 2, 3]]), BlockDiffusionConfig.from_preset("diffusion_gemma"))
    with pytest.raises(ValueError, match="entropy_bound"):
        qwen3.generate_multi_block(torch.tensor([[1, 2, 3]]), BlockDiffusionConfig(entropy_bound=0.2))


def test_preset_takes_the_generation_config_then_transformers_defaults(model, monkeypatch):
    """Unset canvas fields come from the checkpoint's generation config, else transformers' defaults; the preset's
    fields override them (the rules the engine receives are checked)."""
    from hf_blockdiff.canvas import diffusion_gemma

    model.generation_config.max_denoising_steps = 7
    try:
        rules = diffusion_gemma.canvas_rules(model, BlockDiffusionConfig.from_preset("diffusion_gemma"))
        assert (rules.steps, rules.entropy_bound, rules.t_max, rules.t_min, rules.stability, rules.confidence) == (
            7, 0.1, 0.8, 0.4, 1, 0.005)
        rules = diffusion_gemma.canvas_rules(model, BlockDiffusionConfig.from_preset(
            "diffusion_gemma", max_denoising_steps=3, entropy_bound=0.5, t_max=1.0, t_min=0.2, stop_stability=2,
            stop_confidence=0.1))
        assert (rules.steps, rules.entropy_bound, rules.t_max, rules.t_min, rules.stability, rules.confidence) == (
            3, 0.5, 1.0, 0.2, 2, 0.1)
    finally:
        model.generation_config.max_denoising_steps = None


def test_counter_noise_distributions():
    """Gumbel-max with the counter noise samples softmax(z); the renoising tokens are uniform."""
    rules = CanvasRules(length=4096, vocab_size=5, steps=4, entropy_bound=0.1, t_max=0.8, t_min=0.4, stability=1,
                        confidence=0.005)
    noise = CounterNoise(rules, torch.tensor([12345, 777]))
    z = torch.tensor([2.0, 1.0, 0.0, -1.0, float("-inf")])
    expected = torch.softmax(z, -1)
    draws = torch.cat([noise.sample(z.expand(2 * 4096, 5), torch.tensor([c, c]), torch.tensor(s))
                       for c in range(3) for s in range(1, 4)])
    frequency = torch.bincount(draws, minlength=5) / len(draws)
    assert (frequency - expected).abs().max() < 0.01 and frequency[4] == 0
    tokens = uniform_tokens(torch.full((200_000,), 99), torch.arange(200_000), 7)
    counts = torch.bincount(tokens, minlength=7).double()
    chi2 = ((counts - counts.mean()) ** 2 / counts.mean()).sum()
    assert chi2 < 30  # 6 degrees of freedom: p < 1e-4 beyond


def test_counter_noise_is_independent_of_the_batch(model):
    """A prompt decodes the same alone and beside others with the counter noise (its seed is its own)."""
    _, fields = settings(4, bound=3.0, confidence=2.5, stability=0)
    cfg = BlockDiffusionConfig(max_new_tokens=2 * CANVAS, **fields)
    ids, mask = prompts([9, 14])
    both = model.generate_multi_block(ids, cfg, attention_mask=mask, generator=torch.Generator().manual_seed(3))
    alone = model.generate_multi_block(ids[:1, -9:], cfg, generator=torch.Generator().manual_seed(3))
    assert torch.equal(both[0, -2 * CANVAS:], alone[0, -2 * CANVAS:])


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["mixed_moe", "single_expert"])
def test_cuda_graph_step_matches_eager_sdpa_gpu(name):
    """On CUDA: the captured step (triton attention with window starts, compiled layers, CUDA graph) gives the
    tokens of the eager sdpa step with the same counter noise; a later call of other prompt lengths replays the
    engine's graph."""
    model = tiny_diffusion_gemma(name).cuda()
    model.set_experts_implementation("batched_mm")  # float32 grouped GEMMs do not capture (`fusion.capture`)
    _, fields = settings(6, bound=3.0, confidence=2.5, stability=0)
    calls = [tuple(t.cuda() for t in prompts(lengths)) for lengths in ([5, 40, 17], [30, 9, 22])]

    def run(ids, mask, **extra):
        cfg = BlockDiffusionConfig(max_new_tokens=4 * CANVAS, **fields, **extra)
        generator = torch.Generator("cuda").manual_seed(1)
        return model.generate_multi_block(ids, cfg, attention_mask=mask, generator=generator)

    expected = [run(*call, attention_backend="sdpa", cuda_graphs=False, compile=False) for call in calls]
    assert model._blockdiff_engine.graph is None
    graphs = []
    for call, tokens in zip(calls, expected):
        assert torch.equal(run(*call, attention_backend="triton", cuda_graphs=True, compile=True), tokens)
        graphs.append(model._blockdiff_engine.graph)
    assert graphs[0] is not None and graphs[1] is graphs[0]  # captured once, replayed by the later call


@pytest.mark.gpu
def test_torch_order_noise_matches_transformers_gpu():
    """On CUDA (fp32, sdpa): the compatibility noise still reproduces transformers' generate."""
    from diffusion_gemma_models import ours, reference

    model = tiny_diffusion_gemma("mixed_moe").cuda()
    theirs, fields = settings(6, bound=3.0, confidence=2.5, stability=0)
    ids, mask = (t.cuda() for t in prompts([5, 17, 9]))
    expected = reference(model, ids, mask, 3 * CANVAS, theirs, seed=7)
    out = ours(model, ids, mask, 3 * CANVAS, fields, seed=7, noise="torch", attention_backend="sdpa")
    assert torch.equal(out.sequences, expected.sequences)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_nan_logits_stop_the_call_naming_prompt_step_and_canvas(device):
    """Logits that turn NaN (prompt 1's decoder output from the second denoising step on; on CUDA inside the
    captured step) stop the call with the prompt, step and canvas named instead of decoding garbage; the model's
    attention implementation is restored."""
    model = tiny_diffusion_gemma("mixed_moe").to(device)
    model.set_experts_implementation("batched_mm")  # float32 grouped GEMMs do not capture (`fusion.capture`)
    implementation = model.config._attn_implementation
    calls = torch.zeros((), dtype=torch.long, device=device)

    def poison(module, args, output):  # device ops only, so a captured step repeats them
        calls.add_(1)
        prompt_one = torch.arange(output.shape[0], device=device)[:, None, None] == 1
        return torch.where(prompt_one & (calls > 1), float("nan"), output)

    handle = model.model.decoder.norm.register_forward_hook(poison)
    _, fields = settings(6, bound=3.0, confidence=2.5, stability=0)
    ids, mask = (t.to(device) for t in prompts([5, 9]))
    cfg = BlockDiffusionConfig(max_new_tokens=2 * CANVAS, **fields, cuda_graphs=device == "cuda")
    try:
        with pytest.raises(FloatingPointError, match=r"prompt 1 .*inf or nan at denoising step 2 of canvas 0"):
            model.generate_multi_block(ids, cfg, attention_mask=mask)
    finally:
        handle.remove()
    assert model.config._attn_implementation == implementation and not model.training


def test_compiled_layers_enter_decoding_with_per_layer_kv_heads():
    """DiffusionGemma's KV heads vary by layer, which transformers' heterogeneous config refuses to read globally:
    compiled layers key dynamo's profile of their dimensions with the value of each layer instead of raising
    (`fusion.mode.profile_job`; a compiled call raised AmbiguousGlobalPerLayerAttributeError on entering)."""
    from hf_blockdiff.fusion import mode

    model = tiny_diffusion_gemma("single_expert")
    kv_heads = [layer.num_key_value_heads for layer in model.config.get_text_config().per_layer_config]
    assert len(set(kv_heads)) > 1  # the case: a per-layer field
    job = mode.profile_job(model)
    with mode.decoding_mode(model, "compile"):
        assert mode.profile_job(model) == job and job.startswith("hf_blockdiff-")
