"""The bench's random DiffusionGemma: built without allocating the encoder's layers beside the decoder's (they are
tied), with the buffers and the parameter layout of transformers' own construction."""

from __future__ import annotations

import torch
import transformers

from hf_blockdiff.tools.diffusion_gemma_bench import SHAPES, build


def test_bench_model_is_transformers_model_with_tied_stacks():
    model = build("diffusion-gemma-tiny", None, "cpu", torch.bfloat16)
    sizes, canvas = SHAPES["diffusion-gemma-tiny"]
    config = transformers.DiffusionGemmaConfig(text_config=dict(sizes), vision_config={"model_type": "gemma4_vision"},
                                               canvas_length=canvas)
    direct = transformers.DiffusionGemmaForBlockDiffusion._from_config(config, dtype=torch.bfloat16)
    assert model.model.encoder.language_model.layers[1].experts.down_proj is model.model.decoder.layers[1].experts.down_proj
    assert model.lm_head.weight is model.model.decoder.embed_tokens.weight
    ours, theirs = dict(model.named_buffers()), dict(direct.named_buffers())
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[name], theirs[name]) for name in ours)
    ours, theirs = dict(model.named_parameters()), dict(direct.named_parameters())
    assert ours.keys() == theirs.keys()
    for name, param in ours.items():
        assert param.dtype == theirs[name].dtype and param.device.type == "cpu"
        if "vision" in name:  # unused by text decoding; transformers fills one of its tables with ones
            continue
        if (theirs[name] == 1).all():
            assert (param == 1).all(), name
        else:
            assert abs(param.float().std() - 0.02) < 0.005, name
    ids = torch.randint(3, sizes["vocab_size"], (1, 5))
    assert torch.isfinite(model(input_ids=ids).logits).all()


def test_random_prompts_stay_below_the_multimodal_placeholders():
    """DiffusionGemma refuses an image token in a text prompt: the benches draw prompt ids below every placeholder
    (26B-A4B's image token 258,880 lies inside its 262,144-token vocabulary)."""
    from hf_blockdiff.tools.bench_models import prompt_ceiling

    model = build("diffusion-gemma-tiny", None, "cpu", torch.float32)
    assert prompt_ceiling(model) == 95  # the tiny vocabulary (96) sits below its placeholders
    model.config.boi_token_id = 40
    assert prompt_ceiling(model) == 39
