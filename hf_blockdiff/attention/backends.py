"""Attention backends as objects, resolved once from `BlockDiffusionConfig.attention_backend` (docs/kernels.md,
"Kernels and backends").

Every backend reads a query's keys [0, q_limit) of its row from the paged cache. A backend says whether it runs on a
device, checks the config against what it can read (page and block sizes), plans a forward (the metadata its
kernel reads beside the write slots every backend shares), attends, says whether its plan is free of host syncs
(so a step can be a CUDA graph), and how long a prefill chunk may be.

    sdpa        the reference: gathers the dense key range and runs torch's scaled_dot_product_attention (any device)
    triton      the paged block-causal kernel with per-query key limits (CUDA; CPU under TRITON_INTERPRET=1)
    flash_attn  FlashAttention 2/3/4 over the page pools, one key length per block-sized chunk (CUDA)
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from ..cache import ForwardPlan, PagedBlockCache
from ..kernels import TRITON_AVAILABLE, flash
from ..kernels.paged_attention import paged_attention

PREFILL_CHUNK = 128  # tokens per virtual row of a prefill forward (backends that allow any key limits)


class AttentionBackend:
    name = ""
    graph_safe = True  # planning and attending have no host sync
    fuses_norms = False  # the decoder's RMSNorms may run as Triton kernels beside this backend
    how_to_get = ""

    def __init__(self, batch_invariant: bool = False):
        # decode on the batch-invariant kernels (fusion/invariant.py): the triton backend with
        # RuntimeOptions.batch_invariant (elsewhere refused on CUDA, and on the CPU invariant as it is)
        self.batch_invariant = batch_invariant

    @classmethod
    def runs_on(cls, device: torch.device) -> bool:
        return True

    def check(self, block_size: int, page_size: int) -> None:
        """A ValueError before any forward if the config asks for what this backend cannot read."""

    def prefill_chunk(self, block_chunk: int) -> int:
        return PREFILL_CHUNK

    def plan(self, cache: PagedBlockCache, rows: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor,
             q_limit: torch.Tensor) -> ForwardPlan:
        """A forward whose batch row i holds the tokens at `positions[i]` of cache row `rows[i]` (`valid`: real
        tokens); their K/V are written ahead into the rows' pages, where every query reads its keys from."""
        return ForwardPlan(self, q_limit, cache.page_table[rows], cache.slots(rows, positions, valid).reshape(-1))

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cache: PagedBlockCache,
               layer: int, plan: ForwardPlan, scaling: float | None, sliding: bool = False) -> torch.Tensor:
        """[R, W, heads, head_dim] attention output of `query` [R, heads, W, head_dim]; `key`, `value`: what
        `PagedBlockCache.update` returned (None after `update_rotary` where the plan has no read slots: backends that
        read the pools); `sliding`: the layer reads keys from the plan's `q_start` on (sliding-window layers)."""
        raise NotImplementedError


KEY_GRANULE = 64


class SdpaBackend(AttentionBackend):
    name = "sdpa"
    graph_safe = False  # the dense key range is sized on the host

    def plan(self, cache, rows, positions, valid, q_limit):
        plan = super().plan(cache, rows, positions, valid, q_limit)
        # whole multiples of KEY_GRANULE: CPU kernels reduce a vector's tail by other code, so a key range sized to
        # the batch would make a row's attention depend on the rows beside it (docs/architecture.md, "Serving")
        key_length = -(-max(int(q_limit.max()), 1) // KEY_GRANULE) * KEY_GRANULE
        key_positions = torch.arange(key_length, device=q_limit.device).expand(len(rows), key_length)
        plan.read_slots = cache.slots(rows, key_positions, key_positions < q_limit.max(dim=1, keepdim=True).values)
        return plan

    def attend(self, query, key, value, cache, layer, plan, scaling, sliding=False):
        mask = plan.dense_mask(key.shape[2], sliding)
        out = F.scaled_dot_product_attention(
            query, key, value, attn_mask=mask, scale=scaling, enable_gqa=query.shape[1] != key.shape[1]
        )
        return out.transpose(1, 2).contiguous()


class TritonBackend(AttentionBackend):
    name = "triton"
    fuses_norms = True
    how_to_get = ("install triton (`pip install triton`; CUDA builds of torch bundle it); on CPU it runs only under "
                  "TRITON_INTERPRET=1, for testing")

    @classmethod
    def runs_on(cls, device):
        return TRITON_AVAILABLE and (device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1")

    def attend(self, query, key, value, cache, layer, plan, scaling, sliding=False):
        # batch-invariant: one key split (the automatic count follows the grid, i.e. the batch, and the split length
        # the key capacity; docs/architecture.md, "Batch-invariant decoding")
        return paged_attention(query, cache.keys[layer], cache.values[layer], plan.page_table, plan.q_limit, scaling,
                               num_splits=1 if self.batch_invariant else None, q_start=plan.key_start(sliding))


class FlashBackend(AttentionBackend):
    name = "flash_attn"
    how_to_get = ("install FlashAttention (FA2: `pip install flash-attn --no-build-isolation`; FA3: build hopper/ of "
                  "the flash-attention repository; FA4: `pip install flash-attn-4`); it runs on CUDA only")

    @classmethod
    def runs_on(cls, device):
        return device.type == "cuda" and flash.load() is not None

    def check(self, block_size, page_size):
        kernel = flash.load()
        if page_size % kernel.page_multiple:
            raise ValueError(f"page_size={page_size}: {kernel.name} reads pages of a multiple of "
                             f"{kernel.page_multiple} tokens; pass page_size={kernel.page_multiple}.")
        if block_size > 64 and block_size % 64:
            raise ValueError(f"block_size={block_size}: the flash_attn backend needs blocks of at most 64 tokens or a "
                             "multiple of 64 (one key length per 64-token chunk); use attention_backend='triton'.")

    def prefill_chunk(self, block_chunk):
        return block_chunk  # one key length per row

    def plan(self, cache, rows, positions, valid, q_limit):
        plan = super().plan(cache, rows, positions, valid, q_limit)
        plan.key_lengths = q_limit.amax(dim=1).clamp(min=1).int()
        return plan

    def attend(self, query, key, value, cache, layer, plan, scaling, sliding=False):
        if plan.key_start(sliding) is not None:  # refused before any forward (canvas/loop.py)
            raise NotImplementedError("flash_attn reads no lower key limit; use attention_backend='triton'.")
        return flash.load().run(query.transpose(1, 2), cache.keys[layer], cache.values[layer], plan.key_lengths,
                                plan.page_table, scaling)


BACKENDS = (SdpaBackend, FlashBackend, TritonBackend)  # slowest first


def available_backends(device: torch.device) -> tuple[str, ...]:
    """Exact backends usable on `device`, slowest first."""
    return tuple(backend.name for backend in BACKENDS if backend.runs_on(device))


def resolve_backend(requested: str, device: torch.device, block_size: int, page_size: int,
                    batch_invariant: bool = False) -> AttentionBackend:
    """The backend to run: `auto` picks the fastest exact one available (sdpa on CPU). `batch_invariant` on CUDA
    takes the triton backend only (sdpa's and FlashAttention's kernels split the keys by the batch; on the CPU every
    backend is batch-invariant)."""
    available = available_backends(device)
    if requested == "auto":
        requested = available[-1] if device.type == "cuda" else "sdpa"
    if batch_invariant and device.type == "cuda" and requested != "triton":
        raise ValueError(f"BlockDiffusionConfig.runtime.attention_backend={requested!r} cannot decode with "
                         "batch_invariant=True: its CUDA kernels choose how to split the keys by the batch; pass "
                         "attention_backend='triton' (or 'auto').")
    backend_class = next(b for b in BACKENDS if b.name == requested)
    backend = backend_class(batch_invariant and backend_class is TritonBackend)
    if requested not in available:
        raise ValueError(
            f"attention_backend={requested!r} is not available on {device.type}: {backend.how_to_get} "
            f"(available here: {', '.join(available)})."
        )
    backend.check(block_size, page_size)
    return backend
