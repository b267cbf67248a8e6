"""`generate_multi_block`: the public entry point on HF causal LMs (put on the classes by `hf_blockdiff.patching`,
which adds the PEFT adapter handling and the per-model lock around it)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.utils import ModelOutput

from ..config import BlockDiffusionConfig
from ..config.checks import check_block_config
from ..config.profiles import model_profile
from ..weights.tensor_parallel import agreed_seeds, sharded_decoding
from .engine import Results, engine_for, request_seeds
from .hf_conventions import call_arguments, merged_config
from .inputs import check_call, check_lengths, decoding_backend, prompts_of
from .rows import RowProgress
from .stop_strings import StopStrings


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
    **kwargs,
):
    """Block-diffusion decoding of `input_ids` (left-padded [B, P]); see `BlockDiffusionConfig`. Returns a
    LongTensor [B, P + max_new_tokens], or a `BlockDiffusionOutput` with `return_dict` (or `return_dict_in_generate`).

    `config`: a BlockDiffusionConfig, a transformers GenerationConfig (the fields it sets count, num_return_sequences
    and return_dict_in_generate too) or None; keywords (config fields, transformers generation parameters) override
    it as in `generate`. Precedence, highest first:
    keyword > the config's set fields > preset > the model's `generation_config` (logged when it decides something)
    > defaults and the model profile (docs/architecture.md, "Calling conventions").
    `attention_mask`: the tokenizer's, for a padded batch; without it leading pad ids are padding, as in `generate`
    (unless the pad id is also a stop or mask id: a warning says so). Calls from several threads run in turn.
    Runtime options (`max_batch_size`, `attention_backend`, `compile`, ...: `RuntimeOptions`) are keywords too.
    `num_return_sequences=n`:
    every prompt n times (rows prompt-major, each its own seed: the tokens of `input_ids.repeat_interleave(n, 0)`),
    the samples sharing their prompt's K/V pages (docs/architecture.md, "The cache"). PEFT: the active LoRA adapters
    are merged for the call and the base weights restored bit-exactly; `adapters=[name, ...]` decodes once per
    adapter and returns the outputs in that order. `streamer` (batch 1): `put`/`end` as transformers streamers,
    `put_draft` each step if it has one. `stop_strings` (with `tokenizer=`), as transformers': a row stops once the
    decoded text of its committed tokens holds one, and what follows the token completing it is pad.
    `generator`: a torch.Generator (None: torch's default). Bad input, an empty
    batch included, is refused before any forward (docs/architecture.md, "Errors")."""
    call = call_arguments(config, kwargs)
    config = merged_config(self, config, kwargs)
    vocab = getattr(self.config, "vocab_size", None)
    check_block_config(config)
    cfg = config.resolved(model_profile(self), vocab)
    prompts = prompts_of(input_ids, attention_mask, cfg, vocab)
    device = input_ids.device
    check_call(cfg, device, generator, streamer)
    check_lengths(self, prompts, cfg)
    samples = _check_samples(call["num_return_sequences"], streamer)
    backend = decoding_backend(self, cfg, device)
    stops = None if call["stop_strings"] is None else StopStrings(call["stop_strings"], call["tokenizer"])
    stream = _TokenStream(streamer, input_ids, cfg) if streamer is not None else None
    groups = [group for group in range(len(prompts)) for _ in range(samples)]
    prompts = [prompts[group] for group in groups]
    seeds = agreed_seeds(self, request_seeds(len(prompts), generator))
    was_training = self.training
    self.eval()
    try:
        with sharded_decoding(self):
            engine = engine_for(self, cfg, prompts, backend, device, samples)
            results = engine.generate(prompts, seeds, stream, groups, stops)
    finally:
        self.train(was_training)
    sequences = torch.cat([input_ids.repeat_interleave(samples, 0), results.tokens], dim=1)
    return block_output(sequences, results) if return_dict or call["return_dict"] else sequences


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
        self.streamer, self.mask = streamer, cfg.mask_token_id
        self.put_draft = getattr(streamer, "put_draft", None)
        self.wants_drafts = self.put_draft is not None
        streamer.put(input_ids[0].cpu())

    def put_progress(self, progress: RowProgress) -> None:
        """After a step: the row's draft, then its newly committed tokens."""
        if self.put_draft is not None:
            self.put_draft(progress.draft, progress.draft != self.mask)
        if progress.tokens:
            self.streamer.put(torch.tensor(progress.tokens))

    def end(self) -> None:
        self.streamer.end()
