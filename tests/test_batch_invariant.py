"""`RuntimeOptions.batch_invariant` (fusion/invariant.py): a live engine serving rows together gives each the tokens
and logprobs of the offline call of its one prompt, on the invariant kernels (CPU: Triton's interpreter with the
triton backend; GPU: bf16, the proof); what the mode cannot cover is refused before any forward."""

import numpy as np
import pytest
import torch

from hf_blockdiff import BlockDiffusionConfig
from hf_blockdiff.attention import backends, resolve_backend
from hf_blockdiff.config.checks import check_canvas_config
from hf_blockdiff.config.runtime import RuntimeOptions
from hf_blockdiff.fusion import invariant
from hf_blockdiff.fusion.invariant import check_batch_invariant
from hf_blockdiff.generation.live import LiveEngine, RowSettings, row_seeds
from hf_blockdiff.kernels import skinny_gemm

from helpers import MASK, VOCAB, Collector, random_prompts, tiny_model

pytest.importorskip("triton")

CFG = BlockDiffusionConfig(mask_token_id=MASK, block_size=4, attention="block_causal", threshold=0.6,
                           strategy="low_confidence_dynamic", temperature=0.9, eos_token_id=[], pad_token_id=90,
                           attention_backend="triton", batch_invariant=True)
# (prompt length, settings beside the seed): the config's sampling, so every step scores on the fused path
ROWS = [(3, dict(max_new_tokens=8)), (14, dict(max_new_tokens=12, threshold=0.8)), (6, dict(max_new_tokens=5)),
        (9, dict(max_new_tokens=12, threshold=0.4)), (11, dict(max_new_tokens=12))]


@pytest.fixture
def dot_of_a_row_alone(monkeypatch):
    """Triton's interpreter multiplies a `tl.dot` by numpy's matmul, i.e. BLAS, and OpenBLAS's kernels for AVX2 CPUs
    (Haswell, an AMD EPYC here) give a row other bits in a matrix of other rows: `(a[:32] @ b)[:16]` differs from
    `a[:16] @ b` in the last bits. A GPU's MMA sums each output over K in one order whatever its tile holds, which the
    bf16 GPU test below proves; on the CPU the interpreter's dot is made to do the same (einsum: no BLAS, each output
    summed over K in order), so what the CPU test sees is the engine's, not the BLAS build's."""
    from triton.runtime import interpreter

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype.primitive_bitwidth == 8 or b.dtype.primitive_bitwidth == 8:  # fp8 operands: the interpreter's own
            return dot(self, a, b, d, input_precision, max_num_imprecise_acc)
        product = np.einsum("...mk,...kn->...mn", a.data, b.data, dtype=d.data.dtype)
        return interpreter.TensorHandle(product + d.data, d.dtype.scalar)

    dot = interpreter.InterpreterBuilder.create_dot
    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", create_dot)


def served_and_offline(model, cfg, device, slots, rows=ROWS):
    """Each row's (tokens, logprobs) served by a live engine of `slots` slots beside the others, and from the offline
    call of its prompt alone."""
    prompts = random_prompts([length for length, _ in rows], seed=4)
    settings = [RowSettings(seed=row_seeds(i, 1)[0], **given) for i, (_, given) in enumerate(rows)]
    engine = LiveEngine(model, cfg, max_batch_size=slots, max_prompt_tokens=16, max_new_tokens=12)
    served = [Collector() for _ in rows]
    for prompt, row, collector in zip(prompts, settings, served):
        engine.submit(prompt.tolist(), row, collector)
    engine.start()
    for collector in served:
        collector.final(300)
    engine.close()
    offline = []
    for i, (prompt, (_, given)) in enumerate(zip(prompts, rows)):
        out = model.generate_multi_block(prompt[None].to(device), cfg, return_dict=True, **given,
                                         generator=torch.Generator().manual_seed(i))
        kept = int((out.commit_step[0] >= 0).sum())
        offline.append((out.sequences[0, len(prompt):][:kept].tolist(), out.logprobs[0, :kept].tolist()))
    return [(collector.tokens, collector.logprobs) for collector in served], offline


def test_served_rows_equal_their_offline_calls(monkeypatch, dot_of_a_row_alone):
    """fp32 on the CPU under TRITON_INTERPRET=1, three rows on two slots, on the path a GPU takes: every projection and
    the LM head on the invariant launch, attention in one split. The CPU's rows are invariant without it too
    (docs/architecture.md, "Serving"): the bits are proven by the GPU test below and, for the GEMM, by
    tests/kernels/test_invariant_gemm.py. Prefill chunks of 16 tokens keep the interpreter quick."""
    monkeypatch.setattr(backends, "PREFILL_CHUNK", 16)
    model = tiny_model("qwen3", seed=1, num_hidden_layers=1)
    with torch.no_grad():
        model.lm_head.weight.mul_(3)  # confidences spread around the thresholds
    launches, splits = [], []
    launch, attention = skinny_gemm._launch, backends.paged_attention
    monkeypatch.setattr(skinny_gemm, "_launch", lambda *args, **kw: launches.append(
        (args[5], args[1][0].shape[0])) or launch(*args, **kw))
    monkeypatch.setattr(backends, "paged_attention", lambda *args, **kw: splits.append(
        kw["num_splits"]) or attention(*args, **kw))
    rows = [(6, dict(max_new_tokens=8, threshold=0.8)), (3, dict(max_new_tokens=4)), (5, dict(max_new_tokens=8))]
    served, offline = served_and_offline(model, CFG, torch.device("cpu"), 2, rows)
    assert served == offline
    # every launch invariant, the LM head's among them; attention in one split
    assert launches and all(invariant for invariant, _ in launches) and (True, VOCAB) in launches
    assert splits and set(splits) == {1}
    assert all("forward" not in vars(m) for m in model.modules())


def test_what_the_mode_cannot_cover_is_refused():
    with pytest.raises(ValueError, match="runtime.batch_invariant='yes'"):
        RuntimeOptions(batch_invariant="yes")
    with pytest.raises(ValueError, match="runtime.compile=True.*batch_invariant"):
        RuntimeOptions(batch_invariant=True, compile=True)
    with pytest.raises(ValueError, match="attention_backend='sdpa' cannot decode with batch_invariant"):
        resolve_backend("sdpa", torch.device("cuda"), 4, 64, batch_invariant=True)
    moe = tiny_model("qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    with pytest.raises(ValueError, match=r"batch_invariant=True .*decoder layer \(Qwen3MoeDecoderLayer\)"):
        moe.generate_multi_block(torch.tensor([[1, 2, 3]]), CFG, max_new_tokens=4)
    hooked_head, layer_norm = tiny_model("qwen3"), tiny_model("qwen3")
    hooked_head.lm_head.register_forward_hook(lambda *args: None)
    layer_norm.model.norm = torch.nn.LayerNorm(layer_norm.config.hidden_size)
    for model, problem in ((hooked_head, "its LM head"), (layer_norm, r"its final norm \(LayerNorm\)")):
        with pytest.raises(ValueError, match=problem):
            LiveEngine(model, CFG, max_batch_size=2, max_prompt_tokens=8, max_new_tokens=4)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(invariant, "tensor_parallel_size", lambda model: 2)
        with pytest.raises(ValueError, match="tensor-parallel model sums its shards by a kernel chosen by message"):
            check_batch_invariant(tiny_model("qwen3"), resolve_backend("triton", torch.device("cuda"), 4, 64, True))
    with pytest.raises(ValueError, match="runtime.batch_invariant=True .*DiffusionGemma"):
        check_canvas_config(BlockDiffusionConfig(batch_invariant=True))


@pytest.mark.gpu
def test_served_rows_equal_their_offline_calls_bf16_gpu():
    """The proof on a GPU: an SDAR-shaped (Qwen3) bf16 random model under CUDA graphs, rows served three and five at
    a time, each equal in tokens and logprobs to its offline call alone (which runs one slot)."""
    model = tiny_model("qwen3", seed=1, hidden_size=512, intermediate_size=1536, num_attention_heads=8,
                       num_key_value_heads=4, head_dim=64, num_hidden_layers=4, initializer_range=0.1)
    model = model.to("cuda", torch.bfloat16)
    with torch.no_grad():
        model.lm_head.weight.mul_(1.5)  # confidences spread around the thresholds (median ≈ 0.4)
    for slots in (3, 5):
        served, offline = served_and_offline(model, CFG.replace(cuda_graphs=True), torch.device("cuda"), slots)
        assert served == offline, slots
