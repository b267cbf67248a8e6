"""The model executor: everything of a decode step that touches transformers (docs/architecture.md, "Architecture").

It owns the HF forward of the model's decoder, the `PagedBlockCache`, the attention backend, the decoder layers'
fusion, the LM head and the scoring of logits. It knows no decoding policy: the scheduler tells it which tokens to
run (`ForwardLayout`), what a forward stored (`Stored`) and which positions to score (`ScoreRequest`).
"""

from __future__ import annotations

import torch

from ..attention import AttentionBackend
from ..cache import PagedBlockCache
from ..config import BlockDiffusionConfig
from ..scheduler import ForwardLayout, ScoreRequest, Stored
from ..scheduler.chunks import Chunks
from ..strategies.scoring import (SamplingParams, Scores, fused_scoring, logit_salience, penalize_preceding,
                                  score_logits, score_vocab_shards)
from ..fusion.mode import decoding_mode, few_tokens
from ..kernels.skinny_gemm import grouped_linear
from ..weights.tensor_parallel import vocab_shard


HEAD_ROWS = 8


class ModelExecutor:
    def __init__(self, model, cfg: BlockDiffusionConfig, backend: AttentionBackend, fusion: str, rows: int,
                 width: int, device: torch.device, pool_tokens: int, cache: PagedBlockCache | None = None):
        """`pool_tokens`: the KV pages' capacity; `cache`: a cache to keep (it holds the previous engine's prefix
        store), its pool grown as needed."""
        self.model, self.cfg, self.backend, self.fusion = model, cfg, backend, fusion
        self.decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.base_model
        self.lm_head = model.get_output_embeddings()
        self.vocab = vocab_shard(self.lm_head)  # tensor parallel: this process's rows of the LM head
        self.num_rows, self.guided = rows, cfg.guided
        # batch-invariant: every projection and the LM head on the skinny GEMM's invariant launch (fusion/invariant.py)
        self.invariant = backend.batch_invariant
        # the gated MLPs as skinny-GEMM ops too where every denoising forward fits their kernel: the ops take more rows
        # through cuBLAS, but the activation would then run unfused
        self.skinny = self.invariant or (fusion != "none" and few_tokens(cfg, rows))
        layers = model.config.get_text_config().num_hidden_layers
        self.cache = cache if cache is not None else PagedBlockCache(layers, cfg.runtime.page_size)
        self.cache.start(2 * rows if self.guided else rows, width, pool_tokens, device)
        hidden = model.config.get_text_config().hidden_size
        # logit shift: the hidden state before a slot's first undecided position, kept from the forward that stored it
        self.carry = torch.zeros(rows, hidden, dtype=self.lm_head.weight.dtype, device=device)
        self.sampling = SamplingParams(cfg.mask_token_id, cfg.temperature, cfg.top_k, cfg.top_p, cfg.confidence,
                                       cfg.score_precision)

    def forward(self, layout: ForwardLayout) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Flat hidden states [N·C, H] of the layout's chunks (and of the unconditional canvases with guidance)."""
        rows, positions = layout.chunks.rows, layout.positions
        tokens, valid, limits = layout.tokens, layout.chunks.valid, layout.key_limits
        if self.guided:  # the unconditional canvases run beside, in cache rows of their own
            tokens = torch.cat([tokens, layout.unconditional])
            rows = torch.cat([rows, rows + self.num_rows])
            positions, limits, valid = positions.repeat(2, 1), limits.repeat(2, 1), valid.repeat(2, 1)
        plan = self.backend.plan(self.cache, rows, positions, valid, limits.int())
        with decoding_mode(self.model, self.fusion, self.skinny, self.invariant):
            out = self.decoder(input_ids=tokens, position_ids=positions, use_cache=False,
                               blockdiff_cache=self.cache, blockdiff_plan=plan)
        hidden = out.last_hidden_state.reshape(-1, out.last_hidden_state.shape[-1])
        return hidden.chunk(2) if self.guided else (hidden, None)

    def commit(self, stored: Stored, chunks: Chunks | None, hidden: torch.Tensor | None) -> None:
        """Advance the cache's committed lengths to what the forward stored; with a logit shift keep the hidden
        state of each slot's last stored position (it predicts the next one)."""
        rows = torch.arange(len(stored.has), device=stored.has.device)
        self.cache.commit(rows, torch.where(stored.has, stored.length - self.cache.committed[rows], 0))
        if self.cfg.logit_shift and hidden is not None:  # rows whose prefix was reused take the prefix's carry
            index, inside = chunks.locate(rows, stored.length - 1)
            self.carry.copy_(torch.where((stored.has & inside)[:, None], hidden[index], self.carry))

    def score(self, request: ScoreRequest, chunks: Chunks, hidden: torch.Tensor,
              hidden_uncond: torch.Tensor | None) -> Scores:
        """Scores of the requested positions, from the hidden states that predict them."""
        rows, positions = request.rows, request.positions
        index, inside = chunks.locate(rows, positions - int(self.cfg.logit_shift))
        conditional = torch.where(inside[:, None], hidden[index], self.carry[rows])
        if self.by_vocab_shards(request, hidden_uncond):  # no logits gathered: each process scores its shard
            logits = self.head(conditional, self.vocab.weight())
            return score_vocab_shards(logits, self.vocab.first, self.sampling, request.seeds, request.counters,
                                      self.vocab.gather)
        unconditional = None if hidden_uncond is None else hidden_uncond[index]
        logits = self.logits(None if request.canvas is None else request.canvas[rows], conditional, unconditional)
        if request.preceding is not None:
            logits = penalize_preceding(logits, request.preceding, self.cfg.edit_penalty)
        scores = score_logits(logits, self.sampling, request.seeds, request.counters, request.temperature,
                              request.sampling)
        if request.needs_salience:
            scores.salience = logit_salience(logits)
        return scores

    def by_vocab_shards(self, request: ScoreRequest, hidden_uncond: torch.Tensor | None) -> bool:
        """Whether the request scores from the LM head's vocabulary shards (the fused path,
        `strategies.scoring.fused_scoring`; no guidance, penalty, processor or salience: they read whole rows of
        logits)."""
        cfg = self.cfg
        return (self.vocab is not None and hidden_uncond is None and request.preceding is None
                and not request.needs_salience and cfg.repetition_penalty == 1.0 and cfg.logits_processor is None
                and fused_scoring(self.sampling, request.temperature, request.sampling))

    def greedy_scores(self, rows: torch.Tensor, canvas: torch.Tensor | None):
        """The greedy pick from the carried hidden states (a storing forward's decision): (token, log-probability,
        entropy) per row; `canvas`: the decided canvases when a repetition penalty or logits processor reads them."""
        logits = self.logits(None if canvas is None else canvas[rows], self.carry, None).float()
        logits[:, self.cfg.mask_token_id] = float("-inf")
        logp = torch.log_softmax(logits, -1)
        token = logits.argmax(-1)
        entropy = -(logp.exp() * logp.nan_to_num(neginf=0.0)).sum(-1)
        return token, logp.gather(1, token[:, None]).squeeze(1), entropy

    def head(self, hidden: torch.Tensor, shard: torch.Tensor | None = None) -> torch.Tensor:
        """The LM head on rows padded to a multiple of `HEAD_ROWS`: a CPU GEMM computes the last `rows mod 4`
        rows by another kernel, so without it a row's logits would depend on how many rows share the step
        (docs/architecture.md, "Serving"); batch-invariant, in the skinny GEMM's invariant launch. `shard`: this
        process's rows of the LM head's weight instead of the whole head (its logits of them)."""
        if self.invariant:
            weight = self.lm_head.weight if shard is None else shard
            return grouped_linear(hidden, [weight], [self.lm_head.bias], invariant=True)[0]
        rows = len(hidden)
        padded = torch.nn.functional.pad(hidden, (0, 0, 0, -rows % HEAD_ROWS))
        return (self.lm_head(padded) if shard is None else torch.nn.functional.linear(padded, shard))[:rows]

    def logits(self, context: torch.Tensor | None, hidden: torch.Tensor,
               hidden_uncond: torch.Tensor | None) -> torch.Tensor:
        """LM head on gathered hidden states, then guidance and the logits processors ([n, V]; the model's dtype
        unless a processor needs float32: the fused scoring reads bf16 logits as they are). `context`: the rows'
        canvases, read by the repetition penalty and the processors."""
        cfg = self.cfg
        logits = self.head(hidden)
        if hidden_uncond is not None:
            uncond = self.head(hidden_uncond).float()
            logits = uncond + (cfg.cfg_scale + 1) * (logits.float() - uncond)
        if cfg.repetition_penalty != 1.0:
            logits = logits.float()
            present = torch.zeros_like(logits, dtype=torch.bool).scatter_(1, context, True)
            present[:, cfg.mask_token_id] = False
            penalty = cfg.repetition_penalty
            logits = torch.where(present, torch.where(logits > 0, logits / penalty, logits * penalty), logits)
        if cfg.logits_processor is not None:
            logits = cfg.logits_processor(context, logits)
        return logits
