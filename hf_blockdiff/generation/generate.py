"""`generate_multi_block`: the public entry point on HF causal LMs (put on the classes by `hf_blockdiff.patching`,
which adds the PEFT adapter handling and the per-model lock around it)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.utils import ModelOutput

from ..attention import resolve_backend
from ..config import BlockDiffusionConfig
from ..config_checks import check_block_config
from ..profiles import model_profile
from ..quantization import check_quantization
from ..tensor_parallel import check_tensor_parallel
from ..scheduler import DecodeState
from .engine import Results, engine_for, request_seeds
from .inputs import check_call, check_lengths, prompts_of


@dataclass
class BlockDiffusionOutput(ModelOutput):
    """`sequences` [B, P + N]: the prompt as given, then the generated tokens (`pad_token_id` after the first stop
    token). Per generated position [B, N]: `commit_step` (1-based forward index that committed it, -1 if never
    generated), `logprobs` (log-probability of the committed token under the distribution it was drawn from),
    `entropies`. `num_forwards` counts every model forward of the call, prefill and store forwards included; `steps`
    [B] the decoding steps of each prompt (forwards that decided its tokens), and `tokens_per_forward` is tokens committed
    per decoding step (TPF; the rest of the stop token's block counts: it was decoded), independent of how long the
    other prompts of the batch run. `edits` [B]: decided tokens each prompt had replaced by editing (LLaDA2.1,
    `editing_threshold`; a remask is no edit); `commit_step` is then the forward of a position's final write."""

    sequences: torch.LongTensor | None = None
    num_forwards: int | None = None
    tokens_per_forward: float | None = None
    commit_step: torch.LongTensor | None = None
    logprobs: torch.FloatTensor | None = None
    entropies: torch.FloatTensor | None = None
    steps: torch.LongTensor | None = None
    edits: torch.LongTensor | None = None


@torch.no_grad()
def generate_multi_block(
    self,
    input_ids: torch.LongTensor,
    config: BlockDiffusionConfig | None = None,
    attention_mask: torch.Tensor | None = None,
    streamer=None,
    generator: torch.Generator | None = None,
    return_dict: bool = False,
    max_batch_size: int | None = None,
    num_return_sequences: int = 1,
):
    """Block-diffusion decoding of `input_ids` (left-padded [B, P]); see `BlockDiffusionConfig`.

    `attention_mask`: pass the tokenizer's for a padded batch. Without it, as transformers' `generate` does, leading
    pad ids (`pad_token_id`) are taken as padding, unless the pad id is also a stop or mask id: then they would be
    decoded as prompt, and a warning says so. Calls on one model from several threads run one after another.

    At most `max_batch_size` prompts decode at once; finished ones are replaced by waiting ones (prompt
    streaming). Returns a LongTensor [B, P + max_new_tokens], or a `BlockDiffusionOutput` with `return_dict=True`.

    `num_return_sequences=n` decodes every prompt n times (rows [B·n, ...], prompt-major, as transformers groups
    them), each sample with its own seed; the samples of a prompt compute its prefix once and share its K/V pages
    (block-causal modes; docs/design.md, "The cache"). The tokens are those of `input_ids.repeat_interleave(n, 0)`
    with the same generator.

    PEFT: on a `PeftModel` (or a model with adapters from `load_adapter`) the active LoRA adapters are merged into
    the base weights for the call and the base weights are restored bit-exactly after it. `adapters=[name, ...]`
    decodes once per named adapter, each alone, and returns a list of the outputs in that order.
    `streamer`: batch 1; gets `put`/`end` like transformers streamers, and `put_draft` each step if it has one
    (see `_TokenStream`). `generator`: a torch.Generator (None: torch's default one). An empty batch (`input_ids`
    [0, P]; transformers' `generate` fails on one too) is refused before any forward, as all bad input (README)."""
    if config is not None and not isinstance(config, BlockDiffusionConfig):
        raise TypeError("config must be a BlockDiffusionConfig (or None to use the model's profile).")
    vocab = getattr(self.config, "vocab_size", None)
    check_block_config(config or BlockDiffusionConfig())
    cfg = (config or BlockDiffusionConfig()).resolved(model_profile(self), vocab)
    prompts = prompts_of(input_ids, attention_mask, cfg, vocab)
    device = input_ids.device
    check_call(cfg, device, generator, streamer)
    check_lengths(self, prompts, cfg)
    if max_batch_size is not None and (not isinstance(max_batch_size, int) or max_batch_size <= 0):
        raise ValueError(f"max_batch_size={max_batch_size!r}: pass a positive integer (or None for all prompts).")
    samples = _check_samples(num_return_sequences, streamer)
    check_quantization(self)
    check_tensor_parallel(self)
    backend = resolve_backend(cfg.attention_backend, device, cfg.block_size, cfg.page_size)
    stream = _TokenStream(streamer, input_ids, cfg) if streamer is not None else None
    groups = [group for group in range(len(prompts)) for _ in range(samples)]
    prompts = [prompts[group] for group in groups]
    seeds = request_seeds(len(prompts), generator)
    was_training = self.training
    self.eval()
    try:
        engine = engine_for(self, cfg, prompts, max_batch_size, backend, device, samples)
        results = engine.generate(prompts, seeds, stream, groups)
    finally:
        self.train(was_training)
    sequences = torch.cat([input_ids.repeat_interleave(samples, 0), results.tokens], dim=1)
    return block_output(sequences, results) if return_dict else sequences


def block_output(sequences: torch.Tensor, results: Results) -> BlockDiffusionOutput:
    return BlockDiffusionOutput(
        sequences=sequences, num_forwards=results.num_forwards, steps=results.steps,
        tokens_per_forward=int(results.committed.sum()) / max(int(results.steps.sum()), 1),
        commit_step=results.commit_step, logprobs=results.logprobs, entropies=results.entropies, edits=results.edits,
    )


def _check_samples(num_return_sequences, streamer) -> int:
    if isinstance(num_return_sequences, bool) or not isinstance(num_return_sequences, int) or num_return_sequences < 1:
        raise ValueError(f"num_return_sequences={num_return_sequences!r}: pass a positive integer (samples per "
                         "prompt; 1 decodes each prompt once).")
    if streamer is not None and num_return_sequences > 1:
        raise ValueError("streamer follows one sequence: pass num_return_sequences=1 with a streamer.")
    return num_return_sequences


class _TokenStream:
    """Feeds a transformers streamer (batch 1) the tokens of row 0 as soon as everything before them is decided.

    A streamer with a `put_draft(tokens, decided)` method also gets, after every step, the generated part of the
    row: `tokens` a CPU LongTensor [max_new_tokens] holding `mask_token_id` where still undecided, `decided` the
    BoolTensor of positions already decided (in any order; positions past the first stop token are dropped later)."""

    def __init__(self, streamer, input_ids: torch.Tensor, cfg: BlockDiffusionConfig):
        if input_ids.shape[0] != 1:
            raise ValueError("streamer needs a batch of one prompt.")
        self.streamer, self.cfg, self.sent = streamer, cfg, 0
        self.put_draft = getattr(streamer, "put_draft", None)
        streamer.put(input_ids[0].cpu())

    def step(self, state: DecodeState, output_end: tuple[torch.Tensor, torch.Tensor]) -> None:
        """After a step: `output_end` is the scheduler's (last output position, has one) per slot."""
        start = int(state.prompt_len[0])
        row = state.canvas[0, start : start + self.cfg.max_new_tokens]
        undecided = row == self.cfg.mask_token_id
        if self.put_draft is not None:
            self.put_draft(row.to("cpu", copy=True), ~undecided.cpu())  # copies: the canvas keeps changing
        ready = int(undecided.int().argmax()) if bool(undecided.any()) else len(row)
        if self.cfg.editing_threshold is not None:  # a decided token may still be edited until its block completes
            ready = min(ready, _complete_prefix(state) - start)
        end, has_end = output_end
        if bool(has_end[0]):
            ready = min(ready, int(end[0]) - start + 1)
        if ready > self.sent:
            self.streamer.put(row[self.sent : ready].to("cpu", copy=True))
            self.sent = ready

    def end(self) -> None:
        self.streamer.end()


def _complete_prefix(state: DecodeState) -> int:
    """Canvas end of row 0's leading complete decode blocks (complete: no mask left and no longer refining)."""
    incomplete = ~state.status().complete[0]
    if not bool(incomplete.any()):
        return state.canvas.shape[1]
    return int(state.first_block_start[0]) + int(incomplete.int().argmax()) * state.block_size
