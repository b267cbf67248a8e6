"""DiffusionGemma (transformers' `DiffusionGemmaForBlockDiffusion`, transformers ≥ 5.12) on the fast path
(docs/fidelity.md, "DiffusionGemma").

transformers ships the model and its own `generate`; here `generate_multi_block` decodes it through
`canvas.loop`: this module runs the model's own modules (the encoder's and the decoder's layers, rotary
embeddings, self-conditioning block, LM head with its soft cap) over the paged cache, and resolves the canvas
settings from the config, then the checkpoint's generation config, then transformers' defaults. Text only.
"""

from __future__ import annotations

import torch

from ..attention import resolve_backend
from ..config import BlockDiffusionConfig
from ..config.checks import CANVAS_FIELDS, check_canvas_config
from ..config.presets import DIFFUSION_GEMMA_DEFAULTS
from .schedule import CanvasRules
from .loop import CanvasCall, CanvasEngine, CanvasRun, CanvasStream, canvas_width
from ..generation.engine import kept_engine, least_slots, request_seeds, shape_bucket, use_graphs
from ..fusion.mode import decoding_mode, fusion_for
from ..generation.generate import block_output
from ..generation.inputs import check_call, prompts_of
from ..weights.tensor_parallel import agreed_seeds

# our field -> how transformers' DiffusionGemmaGenerationConfig names it
GENERATION_CONFIG_NAMES = dict(max_denoising_steps="max_denoising_steps", t_max="t_max", t_min="t_min",
                               stop_stability="stability_threshold", stop_confidence="confidence_threshold")


class DiffusionGemmaRunner:
    """The model's pieces as `canvas.loop.CanvasModel` wants them; the attention keyword arguments
    (`blockdiff_cache`, `blockdiff_plan`) reach the registered attention function through the stock layers."""

    def __init__(self, model):
        text = model.config.get_text_config()
        self.model, self.layer_types = model, list(text.layer_types)
        self.num_layers, self.hidden_size = text.num_hidden_layers, text.hidden_size
        self.sliding_window = text.sliding_window if "sliding_attention" in self.layer_types else None
        self.encoder, self.decoder = model.model.encoder.language_model, model.model.decoder
        self.dtype = self.decoder.embed_tokens.weight.dtype
        self.softcap = model.final_logit_softcapping

    def _layers(self, stack, hidden: torch.Tensor, positions: torch.Tensor, attention: dict) -> torch.Tensor:
        embeddings = {kind: stack.rotary_emb(hidden, positions, kind) for kind in set(self.layer_types)}
        for layer, kind in zip(stack.layers, self.layer_types):
            hidden = layer(hidden, position_embeddings=embeddings[kind], attention_mask=None, position_ids=positions,
                           **attention)
        return hidden

    def encode(self, tokens: torch.Tensor, positions: torch.Tensor, **attention) -> None:
        """The encoder's layers write the K/V of `tokens`; its output is never read."""
        self._layers(self.encoder, self.encoder.embed_tokens(tokens), positions, attention)

    def denoise(self, tokens, positions, conditioning, **attention) -> torch.Tensor:
        hidden = self.decoder.self_conditioning(self.decoder.embed_tokens(tokens), conditioning)
        return self.decoder.norm(self._layers(self.decoder, hidden, positions, attention))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head's logits, before the final soft cap (`softcap`), which the step's scoring applies in float32
        as the model's forward does."""
        return self.model.lm_head(hidden)

    def conditioning(self, probs: torch.Tensor) -> torch.Tensor:
        """The next step's self-conditioning input: the step's softmax (in the embedding dtype) times the scaled
        embedding matrix. Sharded by vocabulary (tensor parallel), each process multiplies its share of the
        vocabulary and the shares are summed."""
        embed = self.decoder.embed_tokens
        weight = embed.weight
        if hasattr(weight, "device_mesh"):  # a DTensor
            from torch.distributed.tensor import DTensor, Replicate

            return (DTensor.from_local(probs, weight.device_mesh, [Replicate()]) @ weight).full_tensor() \
                * embed.embed_scale.to(self.dtype)
        return (probs @ weight) * embed.embed_scale.to(self.dtype)

    def decoding(self, fusion: str):
        return decoding_mode(self.model, fusion)


def canvas_rules(model, cfg: BlockDiffusionConfig) -> CanvasRules:
    """The canvas settings: the config's, else the checkpoint's generation config, else transformers' defaults."""
    generation = getattr(model, "generation_config", None)
    values = {}
    for name in CANVAS_FIELDS[:-1]:
        value = getattr(cfg, name)
        if value is None and name == "entropy_bound":
            value = getattr(getattr(generation, "sampler_config", None), "entropy_bound", None)
        elif value is None:
            value = getattr(generation, GENERATION_CONFIG_NAMES[name], None)
        values[name] = DIFFUSION_GEMMA_DEFAULTS[name] if value is None else value
    BlockDiffusionConfig(**values)  # the generation config's values pass the same checks as the config's
    text = model.config.get_text_config()
    return CanvasRules(length=model.config.canvas_length, vocab_size=text.vocab_size,
                       steps=values["max_denoising_steps"], entropy_bound=values["entropy_bound"],
                       t_max=values["t_max"], t_min=values["t_min"], stability=values["stop_stability"],
                       confidence=values["stop_confidence"])


@torch.no_grad()
def generate_multi_block(self, input_ids: torch.LongTensor, config: BlockDiffusionConfig | None = None,
                         attention_mask: torch.Tensor | None = None, streamer=None,
                         generator: torch.Generator | None = None, return_dict: bool = False, pixel_values=None):
    """DiffusionGemma's canvas decoding of `input_ids` (left-padded [B, P]); see docs/fidelity.md, "DiffusionGemma".
    Returns [B, P + max_new_tokens] (pad after each prompt's first stop id), or a `BlockDiffusionOutput`."""
    cfg = _checked_config(self, config, input_ids, pixel_values)
    rules = canvas_rules(self, cfg)
    device = input_ids.device
    mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
    prompts = prompts_of(input_ids, mask, cfg, rules.vocab_size)
    check_call(cfg, device, generator, streamer)
    _check_lengths(self, prompts, cfg, rules)
    backend = _backend(self, cfg, device, rules)
    graphs = use_graphs(cfg, backend, device, self) and cfg.noise == "counter"
    generation = getattr(self, "generation_config", None)
    stops = cfg.eos_token_id if cfg.eos_token_id is not None else getattr(generation, "eos_token_id", None)
    stops = () if stops is None else (stops,) if isinstance(stops, int) else tuple(stops)
    pad = cfg.pad_token_id if cfg.pad_token_id is not None else getattr(generation, "pad_token_id", None)
    slots = least_slots(shape_bucket(len(prompts)), cfg, lambda n: fusion_for(cfg, backend, graphs, device, self, n))
    run = CanvasRun(cfg.noise, graphs, fusion_for(cfg, backend, graphs, device, self, slots), cfg.runtime.page_size)
    seeds = agreed_seeds(self, request_seeds(len(prompts), generator)).to(device) if cfg.noise == "counter" else None
    call = CanvasCall(cfg.max_new_tokens, stops, pad, seeds, generator)
    stream = CanvasStream(streamer, input_ids, stops) if streamer is not None else None
    was_training = self.training
    self.eval()
    try:
        results = _engine(self, rules, run, backend, slots, canvas_width(prompts, cfg.max_new_tokens, rules.length),
                          device).generate(prompts, call, stream)
    finally:
        self.train(was_training)
    if stream is not None:
        stream.end()
    sequences = torch.cat([input_ids, results.tokens], dim=1)
    return block_output(sequences, results) if return_dict else sequences


def _engine(model, rules: CanvasRules, run: CanvasRun, backend, slots: int, width: int,
            device: torch.device) -> CanvasEngine:
    """The model's canvas engine if it fits the call, else one of `slots` rows and the width's `shape_bucket`, kept
    on the model for later calls (docs/architecture.md, "The cache")."""
    runner = DiffusionGemmaRunner(model)
    return kept_engine(model, lambda kept: kept.fits(rules, run, backend, slots, width, device, runner.dtype),
                       lambda: CanvasEngine(runner, rules, run, backend, slots, shape_bucket(width), device))


def _checked_config(model, config, input_ids, pixel_values) -> BlockDiffusionConfig:
    """Refusals before any forward (docs/architecture.md, "Errors")."""
    if config is not None and not isinstance(config, BlockDiffusionConfig):
        raise TypeError("config must be a BlockDiffusionConfig (or None for the checkpoint's settings).")
    cfg = config or BlockDiffusionConfig()
    check_canvas_config(cfg)
    image = getattr(model.config, "image_token_id", None)
    if pixel_values is not None or (image is not None and bool((input_ids == image).any())):
        raise ValueError("pixel_values / image tokens: DiffusionGemma's image inputs are not supported yet by "
                         "generate_multi_block; pass text-only input_ids (or use the model's own generate).")
    text = model.config.get_text_config()
    if getattr(text, "use_bidirectional_attention", None) == "all":
        raise ValueError("config.text_config.use_bidirectional_attention='all': the encoder would not be causal, "
                         "which generate_multi_block does not decode; use the model's own generate.")
    if cfg.noise == "torch" and cfg.runtime.cuda_graphs:
        raise ValueError("BlockDiffusionConfig.cuda_graphs=True is invalid with noise='torch': torch's generator is "
                         "drawn on the host; pass noise='counter' or cuda_graphs=None.")
    return cfg


def _check_lengths(model, prompts: list[torch.Tensor], cfg: BlockDiffusionConfig, rules: CanvasRules) -> None:
    length = rules.length
    if isinstance(length, bool) or not isinstance(length, int) or length < 1:
        raise ValueError(f"config.canvas_length={length!r}: the model's canvas needs a positive number of tokens; "
                         "set model.config.canvas_length (256 in the released checkpoints).")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("Every row needs at least one prompt token (a row of attention_mask is all zeros).")
    limit = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    longest = canvas_width(prompts, cfg.max_new_tokens, length)
    if limit is not None and longest > limit:
        raise ValueError(f"The longest prompt plus max_new_tokens={cfg.max_new_tokens} in whole canvases of "
                         f"{length} ({longest} positions) exceeds max_position_embeddings={limit}: lower "
                         "max_new_tokens or shorten the prompt.")


def _backend(model, cfg: BlockDiffusionConfig, device: torch.device, rules: CanvasRules):
    if cfg.runtime.attention_backend == "flash_attn":
        raise ValueError("BlockDiffusionConfig.attention_backend='flash_attn' is invalid for DiffusionGemma: its "
                         "sliding-window layers need a lower key limit that only 'triton' and 'sdpa' read; pass "
                         "attention_backend='triton' (or 'auto').")
    backend = resolve_backend(cfg.runtime.attention_backend, device, rules.length, cfg.runtime.page_size)
    if backend.name == "flash_attn":  # auto picked it: Triton is missing
        return resolve_backend("sdpa", device, rules.length, cfg.runtime.page_size)
    return backend
