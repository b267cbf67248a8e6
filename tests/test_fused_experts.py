"""The experts kernel in decoding (fusion/experts.py): which modules take it, and the tokens they keep."""

import torch

from hf_blockdiff import BlockDiffusionConfig
from hf_blockdiff.fusion import experts as fused_experts, mode as fusion
from hf_blockdiff.fusion.experts import fused_experts as experts_of

from helpers import MASK, left_pad, random_prompts, tiny_model

MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # Triton on CPU: TRITON_INTERPRET (tests/conftest.py)


def test_stock_experts_are_taken_and_others_left():
    model = tiny_model("qwen3_moe", **MOE)
    assert [type(m).__name__ for m, _ in experts_of(model)] == ["Qwen3MoeExperts"] * 2
    hooked = tiny_model("qwen3_moe", **MOE)
    hooked.model.layers[0].mlp.experts.register_forward_hook(lambda *args: None)
    assert len(experts_of(hooked)) == 1
    assert experts_of(tiny_model("qwen3_moe", hidden_act="gelu", **MOE)) == []  # an activation the kernel lacks
    assert experts_of(tiny_model("qwen3")) == []


def test_installing_again_compiles_nothing_again():
    """`decoding_mode` installs its forwards at every forward; a compiled layer calling them keeps its one graph
    across installs (a functools.partial per install recompiled it at each forward up to dynamo's limit, then it ran
    eager: DiffusionGemma with 4 layers at batch 16 took twice as long on an H100)."""
    from torch._dynamo.utils import counters

    model = tiny_model("qwen3_moe", **MOE)
    block = model.model.layers[0].mlp
    compiled = torch.compile(type(block).forward, backend="eager")
    hidden = torch.randn(1, 3, model.config.hidden_size)
    torch._dynamo.reset()
    counters.clear()
    for _ in range(3):
        with fusion.decoding_mode(model, fusion="norms"):
            compiled(block, hidden)
    assert counters["stats"]["unique_graphs"] == 1


def test_every_installed_forward_is_the_same_function_at_each_install():
    """The norms', attentions', MLPs', decoder layers' and experts' forwards `decoding_mode` installs are methods of
    module-level functions, the same at every install (a partial, closure or lambda would be new each time)."""
    import inspect

    model = tiny_model("qwen3_moe", **MOE)

    def installed():
        with fusion.decoding_mode(model, fusion="norms", skinny=True):
            return {name: vars(m)["forward"] for name, m in model.named_modules() if "forward" in vars(m)}

    first, second = installed(), installed()
    assert len(first) > 10 and first.keys() == second.keys()
    for name, forward in first.items():
        assert inspect.ismethod(forward) and "<locals>" not in forward.__func__.__qualname__, name
        assert second[name].__func__ is forward.__func__, name


def decode_counting_experts(monkeypatch, lengths, seed, backends=("sdpa", "triton"), new_tokens=8,
                            experts_only=False):
    """The tiny MoE model decoding prompts of `lengths` with each backend: (model, sequences per backend, token count
    of every `moe_experts` call). `experts_only`: the attentions and decoder layers keep their stock forwards (their
    fused ones, tested in test_fused_layers.py, cost most of the interpreted run's time)."""
    model = tiny_model("qwen3_moe", **MOE).to(DEVICE)
    calls = []
    kernel = fused_experts.moe_experts
    monkeypatch.setattr(fused_experts, "moe_experts", lambda *args: calls.append(args[0].shape[0]) or kernel(*args))
    if experts_only:
        monkeypatch.setattr(fusion, "fused_forwards", lambda *args, **kwargs: [])
    ids, mask = left_pad(random_prompts(lengths, seed=seed))
    config = BlockDiffusionConfig(mask_token_id=MASK, block_size=4, max_new_tokens=new_tokens, threshold=0.6,
                                  eos_token_id=[], attention="block_causal", alignment="absolute")
    sequences = [model.generate_multi_block(ids.to(DEVICE), config.replace(attention_backend=backend),
                                            attention_mask=mask.to(DEVICE)) for backend in backends]
    return model, sequences, calls


def test_decoding_runs_the_kernel_and_keeps_the_tokens(monkeypatch):
    """Triton backend (TRITON_INTERPRET on CPU): every denoising forward's experts on the kernel, tokens equal to the
    sdpa backend's (transformers' own experts forward); the model's forwards are back after the call. The attentions
    keep their stock forwards: their fused ones are test_fused_layers.py's, the same functions for Qwen3-MoE."""
    model, (plain, fused), calls = decode_counting_experts(monkeypatch, (9, 4, 6), seed=5, experts_only=True)
    assert torch.equal(plain, fused)
    assert len(calls) >= 2 * 4 and min(calls) <= 12  # two MoE layers per forward, denoising forwards of 12 tokens
    assert all("forward" not in vars(m) for m in model.modules())


def test_a_long_prefill_takes_the_grouped_gemm_and_keeps_the_tokens(monkeypatch):
    """Prompts of 64 and 70 tokens: the prefill's 268 pairs over 8 experts are many (torch's grouped GEMM between
    the kernels' grouping and weighted sum), the denoising forwards' few; tokens equal to the sdpa backend's."""
    from hf_blockdiff.kernels.moe_experts import few_pairs

    _, (plain, fused), calls = decode_counting_experts(monkeypatch, (70, 64), seed=6, new_tokens=4, experts_only=True)
    assert torch.equal(plain, fused)
    assert any(not few_pairs(tokens, 2, 8) for tokens in calls) and any(few_pairs(tokens, 2, 8) for tokens in calls)


def test_many_pairs_keep_the_class_forward_where_the_grouped_gemm_reads_back(monkeypatch):
    """Where torch's grouped GEMM would read the group sizes back to the host (an A100, fp32 weights:
    `grouped_mm_captures` false when the forwards are installed), the long prefill's many pairs run the class's own
    forward; the few pairs of the denoising forwards still take the op."""
    from hf_blockdiff.kernels.moe_experts import few_pairs

    monkeypatch.setattr(fused_experts, "grouped_mm_captures", lambda weight: False)
    _, _, calls = decode_counting_experts(monkeypatch, (70, 64), seed=6, backends=("triton",), new_tokens=4,
                                          experts_only=True)
    assert calls and all(few_pairs(tokens, 2, 8) for tokens in calls)
