"""GPU checks (run on the device machine: `python -m pytest -m gpu tests`): Triton, CUDA graphs and compiled layers
(with the compiled scheduler calls) give the tokens of the eager sdpa path; graphs are reused across calls and
freed; bf16 4B-shape decoding agrees with sdpa until the decision margin is within bf16 noise."""

import time
import warnings

import pytest
import torch
from torch._dynamo.utils import counters

from hf_blockdiff import BlockDiffusionConfig, free_cache
from hf_blockdiff.generation import engine as engine_module
from hf_blockdiff.fusion import ahead_of_time, compile_worker
from hf_blockdiff.generation.step import PHASES, DecodeStep, compiled_phase
from hf_blockdiff.tools.bench import build_model
from hf_blockdiff.kernels import flash
from reference_loops import staircase

from helpers import MASK, Collector, forget_compiled_regions, left_pad, random_prompts, tiny_model

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")


def generate(model, prompts, **settings):
    ids, mask = left_pad(prompts)
    cfg = BlockDiffusionConfig(**{"mask_token_id": MASK, "block_size": 4, "max_new_tokens": 16, "threshold": 0.6,
                                  "eos_token_id": [], **settings})
    return model.generate_multi_block(ids.to(CUDA), cfg, attention_mask=mask.to(CUDA), return_dict=True,
                                      generator=torch.Generator().manual_seed(5))


@pytest.mark.parametrize("mode", [
    dict(attention="block_causal"),
    dict(attention="block_causal", fused_store=False),
    dict(attention="block_causal", alignment="prompt_end", logit_shift=True, max_active_blocks=3,
         block_add_threshold=0.5, decoded_token_threshold=0.5),
    dict(attention="bidirectional", approx_cache="dual"),
    dict(attention="bidirectional", max_active_blocks=3, block_add_threshold=0.5, decoded_token_threshold=0.5,
         strategy="entropy_threshold", threshold=1.0, forced_token_scope="all_active"),
    dict(attention="block_causal", temperature=0.8, top_k=20),
    dict(attention="block_causal", editing_threshold=0.5, remask_threshold=0.3, stability_threshold=0.5,
         edit_penalty=1.0, max_post_steps=2),  # LLaDA2.1 / Diffulex edit: remasks, edits, refinement steps
    dict(attention="block_causal", max_forwards=5, max_repeat_run=4),  # request limits, inside the captured step
    dict(attention="block_causal", fused_store=False, prompt_attention="bidirectional"),  # dllm_var's prefill
])
def test_triton_graphs_and_compile_equal_eager_sdpa_fp32(mode):
    model = tiny_model("qwen3").to(CUDA)
    prompts = random_prompts((9, 4, 6, 13, 5), seed=31)
    eager = generate(model, prompts, attention_backend="sdpa", cuda_graphs=False, **mode)
    triton_eager = generate(model, prompts, attention_backend="triton", cuda_graphs=False, **mode)
    graphs = generate(model, prompts, attention_backend="triton", cuda_graphs=True, compile=False, **mode)
    with torch._dynamo.config.patch(recompile_limit=64):  # every mode's scheduler calls compiled, none left eager
        compiled = generate(model, prompts, attention_backend="triton", cuda_graphs=True, compile=True, **mode)
    step = model._blockdiff_engine.decode_step  # compiled layers come with the compiled scheduler calls
    assert [getattr(step, name).__func__ for name in PHASES] == [compiled_phase(name) for name in PHASES]
    assert torch.equal(eager.sequences, triton_eager.sequences)
    assert torch.equal(eager.sequences, graphs.sequences)
    assert torch.equal(eager.sequences, compiled.sequences)
    assert eager.num_forwards == graphs.num_forwards


def _eager_bookkeeping(scheduler, executor, _):
    return DecodeStep(scheduler, executor, False)


@pytest.mark.parametrize("mode", [
    dict(attention="block_causal", block_size=8, temperature=0.9, pos_temp_slope=0.7),  # per-position temperatures
    dict(attention="block_causal", alignment="prompt_end", max_active_blocks=3, block_add_threshold=0.5,
         decoded_token_threshold=0.5, strategy="entropy_threshold", threshold=1.0, eos_fill=True,
         eos_token_id=[29]),  # d3LLM's EOS fill after a stop token
    dict(attention="bidirectional", block_size=8, strategy="maskgit_plus", steps_per_block=7),  # Dream's schedule
])
def test_compiled_bookkeeping_equals_eager_bookkeeping(mode, monkeypatch):
    """Compiled layers with the scheduler calls compiled or eager: the same tokens, forwards and per-token records,
    in the modes whose bookkeeping does float arithmetic or runs only with stop tokens."""
    model = tiny_model("qwen3").to(CUDA)
    prompts = random_prompts((9, 4, 6, 13, 5), seed=35)
    run = dict(attention_backend="triton", cuda_graphs=True, compile=True, **mode)
    # the compile tests before this one take most of dynamo's 8 entries per scheduler call; past them it would run
    # the "compiled" side eager and compare eager with eager
    with torch._dynamo.config.patch(recompile_limit=64):
        # a first call compiles the layers (in a process without dynamo's shape profile: static at the prefill, then
        # dynamic), so the calls compared run the same layer kernels and differ in their bookkeeping only
        generate(model, prompts, **run)
        free_cache(model)
        compiled = generate(model, prompts, **run)
        free_cache(model)
        monkeypatch.setattr(engine_module, "DecodeStep", _eager_bookkeeping)
        eager = generate(model, prompts, **run)
    assert torch.equal(compiled.sequences, eager.sequences)
    assert compiled.num_forwards == eager.num_forwards
    for record in ("logprobs", "entropies", "commit_step"):
        assert torch.equal(getattr(compiled, record), getattr(eager, record)), record


def test_bookkeeping_and_regions_compiled_by_the_worker_under_cuda_graphs(tmp_path, monkeypatch):
    """A cold process with the compile worker on (fusion/compile_worker.py): its first call runs the layers' regions
    and the bookkeeping eager, in its captured graphs, while the worker compiles them; then the same engine captures
    its graphs again with what the worker saved, whose kernels' configurations the worker chose at its first runs.
    Nothing is traced or autotuned here; the tokens are the eager bookkeeping's, the records too once compiled (eager
    regions round as eager ops do: fp32 records to 1e-5)."""
    if not ahead_of_time.AVAILABLE:
        pytest.skip(f"torch {torch.__version__} has no aot_compile: no compile worker")
    running = compile_worker.WORKER.process
    if running is not None:  # one started with another inductor cache (it inherits ours): gone before the first job
        running.kill()
        for _ in range(300):
            if compile_worker.WORKER.process is not running:
                break
            time.sleep(0.1)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    model = tiny_model("qwen3").to(CUDA)
    prompts = random_prompts((9, 4, 6, 13, 5), seed=37)
    run = dict(attention_backend="triton", cuda_graphs=True, compile=True, attention="block_causal", block_size=8,
               temperature=0.9, pos_temp_slope=0.7)
    compiled_phase.cache_clear()  # a cold process: nothing compiled in memory or in the directory
    torch._dynamo.reset()
    forget_compiled_regions()
    traced, trace = [], ahead_of_time.AheadOfTime._compile
    monkeypatch.setattr(ahead_of_time.AheadOfTime, "_compile",
                        lambda self, args, kwargs: traced.append(self.name) or trace(self, args, kwargs))
    from_worker, ask = [], ahead_of_time.AheadOfTime._from_worker

    def asked(self, *args):
        from_worker.append((self.name, ask(self, *args)))
        return from_worker[-1][1]

    monkeypatch.setattr(ahead_of_time.AheadOfTime, "_from_worker", asked)
    ahead_of_time.use_directory(tmp_path, in_worker=True)
    frames = counters["frames"]["ok"]
    try:
        first = generate(model, prompts, **run)  # eager here, the worker traces
        engine = model._blockdiff_engine
        assert compile_worker.WORKER.settle(600)
        chosen = set((tmp_path / "inductor").rglob("*.best_config"))  # by the worker's first runs
        then = generate(model, prompts, **run)  # the same engine: its graphs captured again
        assert chosen and set((tmp_path / "inductor").rglob("*.best_config")) == chosen  # none autotuned here
        assert model._blockdiff_engine is engine
        free_cache(model)
        monkeypatch.setattr(engine_module, "DecodeStep", _eager_bookkeeping)
        eager = generate(model, prompts, **run)  # the regions as the worker saved them, the bookkeeping eager
    finally:
        ahead_of_time.use_directory(None)
    assert traced == [] and counters["frames"]["ok"] == frames
    names = set(PHASES) | {"before_attention", "after_attention"}
    assert {path.name.split("-")[0] for path in tmp_path.glob("*/*.bin")} == names
    assert {name for name, answer in from_worker if answer is ahead_of_time.EAGER} == names  # while it ran
    assert {name for name, answer in from_worker if answer not in (None, ahead_of_time.EAGER)} == names  # then
    assert torch.equal(first.sequences, eager.sequences) and torch.equal(then.sequences, eager.sequences)
    for record in ("logprobs", "entropies", "commit_step"):
        assert torch.equal(getattr(then, record), getattr(eager, record)), record
        torch.testing.assert_close(getattr(first, record), getattr(eager, record), rtol=1e-5, atol=1e-5)


def test_bookkeeping_and_regions_loaded_ahead_of_time_decode_as_eager(tmp_path, monkeypatch):
    """The step's bookkeeping and the layers' regions compiled ahead of time into a compile cache, then loaded as a
    later process loads them (nothing compiled in memory), under CUDA graphs: nothing traced, the uncompiled sdpa
    decode's tokens, and the eager bookkeeping's tokens and records (generation/precompiled.py,
    fusion/regions.py)."""
    if not ahead_of_time.AVAILABLE:
        pytest.skip(f"torch {torch.__version__} has no aot_compile: both are traced in each process")
    model = tiny_model("qwen3").to(CUDA)
    prompts = random_prompts((9, 4, 6, 13, 5), seed=36)
    mode = dict(attention="block_causal", block_size=8, temperature=0.9, pos_temp_slope=0.7)
    run = dict(attention_backend="triton", cuda_graphs=True, compile=True, **mode)
    reference = generate(model, prompts, attention_backend="sdpa", cuda_graphs=False, compile=False, **mode)
    ahead_of_time.use_directory(tmp_path)
    try:
        generate(model, prompts, **run)  # traced ahead of time and saved
        free_cache(model)
        assert {path.name.split("-")[0] for path in tmp_path.glob("bookkeeping/*.bin")} == set(PHASES)
        assert {path.name.split("-")[0] for path in tmp_path.glob("regions/*.bin")} == {
            "before_attention", "after_attention"}
        compiled_phase.cache_clear()  # a later process: nothing compiled in memory
        torch._dynamo.reset()
        forget_compiled_regions()
        traced, trace = [], ahead_of_time.AheadOfTime._compile
        monkeypatch.setattr(ahead_of_time.AheadOfTime, "_compile",
                            lambda self, args, kwargs: traced.append(self.name) or trace(self, args, kwargs))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loaded = generate(model, prompts, **run)
        free_cache(model)
        monkeypatch.setattr(engine_module, "DecodeStep", _eager_bookkeeping)
        eager = generate(model, prompts, **run)  # the regions as loaded, the bookkeeping eager
    finally:
        ahead_of_time.use_directory(None)
    assert traced == []  # every phase and region loaded from the directory
    assert not [w for w in caught if "ahead of time" in str(w.message) or "compile cache" in str(w.message)]
    assert torch.equal(loaded.sequences, reference.sequences)
    assert torch.equal(loaded.sequences, eager.sequences)
    for record in ("logprobs", "entropies", "commit_step"):
        assert torch.equal(getattr(loaded, record), getattr(eager, record)), record


@pytest.mark.parametrize("max_batch_size, store", [(None, 0), (5, 0), (5, 64)])
def test_shared_prefix_samples_under_graphs_equal_repeated_prompts(max_batch_size, store):
    """num_return_sequences under CUDA graphs (pages change between captured steps), streamed or not, with the
    prefix store filled by a first call or without it."""
    model = tiny_model("qwen3").to(CUDA)
    ids, mask = left_pad(random_prompts((13, 22, 9), seed=33))
    cfg = BlockDiffusionConfig(mask_token_id=MASK, block_size=4, max_new_tokens=16, threshold=0.6, eos_token_id=[],
                               attention="block_causal", temperature=1.0, page_size=8, cuda_graphs=True,
                               prefix_cache_tokens=store)
    def run(ids, mask, **kwargs):
        return model.generate_multi_block(ids.to(CUDA), cfg, attention_mask=mask.to(CUDA), return_dict=True,
                                          max_batch_size=max_batch_size, generator=torch.Generator().manual_seed(5),
                                          **kwargs)

    shared = [run(ids, mask, num_return_sequences=4) for _ in range(2)]  # the second reads the store if on
    plain = run(ids.repeat_interleave(4, 0), mask.repeat_interleave(4, 0))
    assert torch.equal(shared[0].sequences, shared[1].sequences)
    shared = shared[1]
    assert torch.equal(shared.sequences, plain.sequences)


@pytest.mark.parametrize("quantization, dtype", [("int8", torch.float32), ("fp8", torch.bfloat16)])
def test_quantized_weights_under_graphs_and_compile(quantization, dtype):
    """torchao weight-only layers on the fast path: CUDA graphs give the eager tokens (same kernels); compiled layers
    too in fp32, and in bf16 (where inductor's fusions round differently) on almost every position."""
    from hf_blockdiff.tools.bench_models import _quantization_config

    quantize_ = pytest.importorskip("torchao.quantization", reason="torchao is not installed").quantize_

    model = tiny_model("qwen3").to(CUDA, dtype)
    config = _quantization_config(quantization)
    quantize_(model, config.quant_type, filter_fn=lambda module, name: isinstance(module, torch.nn.Linear)
              and "lm_head" not in name)
    model.config.quantization_config = config
    prompts = random_prompts((9, 4, 6, 13), seed=34)
    run = dict(attention="block_causal", attention_backend="triton")
    eager = generate(model, prompts, cuda_graphs=False, compile=False, **run).sequences
    graphs = generate(model, prompts, cuda_graphs=True, compile=False, **run).sequences
    compiled = generate(model, prompts, cuda_graphs=True, compile=True, **run).sequences
    assert torch.equal(eager, graphs)
    agreement = (compiled == eager).float().mean().item()
    print(f"{quantization}: compiled layers agree with eager on {agreement:.1%} of positions")
    assert agreement == 1.0 if dtype == torch.float32 else agreement >= 0.9



def test_bitsandbytes_nf4_decodes_as_the_reference_loop(tmp_path):
    """A model loaded with bitsandbytes 4-bit (nf4, fp32 compute) decodes, graphs and compile turned off, the tokens
    the plain loop gets from the same quantized model."""
    pytest.importorskip("bitsandbytes")
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig
    from reference_loops import sdar_reference

    tiny_model("qwen3").save_pretrained(tmp_path)
    quantized = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=quantized, dtype=torch.float32,
                                                 device_map="cuda").eval()
    assert type(model.model.layers[0].mlp.up_proj).__name__ == "Linear4bit"
    prompts = random_prompts((9, 4, 13), seed=35)
    settings = dict(attention="block_causal", fused_store=False, strategy="low_confidence_dynamic")
    out = generate(model, prompts, **settings).sequences[:, -16:].cpu()
    plain = generate(tiny_model("qwen3").to(CUDA), prompts, **settings).sequences[:, -16:].cpu()
    assert not torch.equal(out, plain)  # the nf4 weights decode differently: the model under test is quantized
    for row, prompt in enumerate(prompts):
        tokens, _ = sdar_reference(model, prompt, MASK, 4, 4, 16, "low_confidence_dynamic", 0.6)
        assert out[row].tolist() == tokens.tolist()

def test_graphs_are_reused_across_calls_and_freed():
    model = tiny_model("qwen3").to(CUDA)
    prompts = random_prompts((9, 4, 6), seed=32)
    first = generate(model, prompts, attention="block_causal")
    graphs = dict(model._blockdiff_engine.step.__self__.graphs)
    assert graphs
    second = generate(model, prompts, attention="block_causal")
    assert torch.equal(first.sequences, second.sequences)
    assert model._blockdiff_engine.step.__self__.graphs == graphs  # nothing captured again
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    free_cache(model)
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() < before


def decision_margin(model, canvas, prompt_len, position, block):
    """Top-1 minus top-2 probability at `position` given the canvas (the block's undecided slots masked)."""
    length = (position // block + 1) * block
    tokens = canvas[:length].clone()
    allowed = staircase(length, prompt_len, block, "absolute").to(CUDA)
    bias = torch.zeros(1, 1, length, length, device=CUDA, dtype=torch.bfloat16).masked_fill(~allowed, -1e4)
    with torch.no_grad():
        logits = model(input_ids=tokens[None], attention_mask=bias, position_ids=torch.arange(length, device=CUDA)[None]).logits
    probs = torch.softmax(logits[0, position].float(), -1)
    top = probs.topk(2).values
    return float(top[0] - top[1])


def test_bf16_4b_shapes_agree_with_sdpa_while_margins_exceed_noise():
    model = build_model("sdar-4b", None, "cuda", torch.bfloat16)
    with torch.no_grad():  # random weights give near-uniform distributions: sharpen them so decisions have margins
        model.lm_head.weight.mul_(4)
    mask = model.config.mask_token_id
    prompt = torch.randint(0, mask - 1, (1, 64), generator=torch.Generator().manual_seed(0)).to(CUDA)
    outputs = {}
    for backend in ("sdpa", "triton") + (("flash_attn",) if flash.load() else ()):
        cfg = BlockDiffusionConfig(mask_token_id=mask, block_size=4, max_new_tokens=64, strategy="sequential",
                                   attention="block_causal", eos_token_id=[], attention_backend=backend)
        outputs[backend] = model.generate_multi_block(prompt, cfg)[0]
    for backend in set(outputs) - {"sdpa"}:
        a, b = outputs["sdpa"], outputs[backend]
        differ = (a != b).nonzero().flatten()
        print(f"bf16 sdar-4b, {backend}: {len(differ)} of 64 generated positions differ from sdpa; first at "
              f"{(differ[:1] - 64).tolist()}")
        if len(differ):
            first = int(differ[0])
            canvas = a.clone()
            canvas[first:] = mask
            margin = decision_margin(model, canvas, 64, first, 4)
            print(f"decision margin at the first difference: {margin:.4f}")
            assert margin < 0.05  # within bf16 noise: both choices are legitimate
    free_cache(model)


@pytest.mark.skipif(flash.load() is None, reason="no FlashAttention (FA2/FA3/FA4) installed on this machine")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_flash_paged_call_equals_the_fp64_reference(dtype):
    """Ragged key lengths (1 .. 4100, padding rows at 1), GQA 32/8, head dim 128, pages of 64 in shuffled order."""
    gen = torch.Generator(CUDA).manual_seed(7)
    lengths = torch.tensor([1, 63, 64, 65, 200, 1000, 4100, 1], dtype=torch.int32, device=CUDA)
    pages_per_row = 65
    pool = torch.randn(len(lengths) * pages_per_row + 1, 64, 8, 128, generator=gen, device=CUDA)
    k_pages, v_pages = pool.to(dtype), torch.randn(pool.shape, generator=gen, device=CUDA).to(dtype)
    table = (torch.randperm(len(lengths) * pages_per_row, generator=gen, device=CUDA) + 1).view(len(lengths), -1)
    q = torch.randn(len(lengths), 4, 32, 128, generator=gen, device=CUDA).to(dtype)
    out = flash.load().run(q, k_pages, v_pages, lengths, table.int(), 128**-0.5)
    ref = flash.flash_paged_reference(q.double(), k_pages.double(), v_pages.double(), lengths, table.int(), 128**-0.5)
    assert not out.isnan().any()
    error = (out.double() - ref).norm() / ref.norm()
    assert error < 1e-2, error


@pytest.mark.skipif(flash.load() is None, reason="no FlashAttention (FA2/FA3/FA4) installed on this machine")
@pytest.mark.parametrize("graphs", [False, True])
def test_flash_backend_equals_triton_bf16_tiny(graphs):
    """Tiny bf16 model (FlashAttention has no fp32): every decoding mode gives the Triton backend's tokens."""
    model = tiny_model("qwen3", hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    model = model.to(CUDA, torch.bfloat16)
    prompts = random_prompts((9, 4, 6, 13, 5), seed=33)
    for mode in (dict(attention="block_causal"), dict(attention="block_causal", fused_store=False),
                 dict(attention="bidirectional", approx_cache="dual")):
        outputs = [generate(model, prompts, attention_backend=backend, cuda_graphs=graphs, compile=False, **mode)
                   for backend in ("triton", "flash_attn")]
        assert torch.equal(outputs[0].sequences, outputs[1].sequences), mode


@pytest.mark.parametrize("run", [dict(cuda_graphs=True), dict(cuda_graphs=True, compile=True)])
def test_live_engine_rows_equal_offline_under_graphs(run):
    """The live engine on CUDA (graphs, optionally compiled layers and bookkeeping): rows of mixed lengths and
    sampling settings joining at different times give the tokens of their own offline calls (fp32 tiny model)."""
    from hf_blockdiff.generation.live import LiveEngine, RowSettings, row_seeds

    model = tiny_model("qwen3", seed=1).to(CUDA)
    with torch.no_grad():
        model.lm_head.weight.mul_(3)
    cfg = BlockDiffusionConfig(mask_token_id=MASK, block_size=4, attention="block_causal", threshold=0.6,
                               strategy="low_confidence_dynamic", eos_token_id=[], attention_backend="triton", **run)
    rows = [(3, dict(max_new_tokens=8)), (14, dict(max_new_tokens=16, temperature=0.9, top_k=5)),
            (6, dict(max_new_tokens=5, temperature=1.3, top_p=0.9, threshold=0.8)), (9, dict(max_new_tokens=12,
            temperature=2.0)), (11, dict(max_new_tokens=16, threshold=0.9)), (5, dict(max_new_tokens=16))]
    prompts = random_prompts([length for length, _ in rows], seed=4)
    engine = LiveEngine(model, cfg, max_batch_size=3, max_prompt_tokens=16, max_new_tokens=16)
    served = [Collector() for _ in rows]
    engine.start()
    for i, (prompt, (_, given)) in enumerate(zip(prompts, rows)):
        engine.submit(prompt.tolist(), RowSettings(seed=row_seeds(i, 1)[0], **given), served[i])
    for row in served:
        row.final(120)
    engine.close()
    for i, (prompt, (_, given)) in enumerate(zip(prompts, rows)):
        sampling = {k: v for k, v in given.items() if k != "max_new_tokens"}
        out = model.generate_multi_block(prompt[None].to(CUDA), cfg, max_new_tokens=given["max_new_tokens"],
                                         generator=torch.Generator().manual_seed(i), **sampling)
        assert served[i].tokens == out[0, len(prompt):].tolist(), i
