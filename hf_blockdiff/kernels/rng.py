"""Counter-based noise for Gumbel-max sampling, identical in torch and in the Triton scoring kernel.

u(seed, counter, token) = (fmix32(key ^ fmix32(token)) >> 9 + 0.5) / 2**23 with key = fmix32(seed * φ + counter),
all arithmetic mod 2**32 (fmix32 is MurmurHash3's finalizer). A row's noise depends only on its own seed and
counters, so other rows in a batch never change it, and no generator state is advanced inside a step. 23 bits
keep every u exact in float32 and strictly inside (0, 1) (from 2**-24 to 1 - 2**-24), so the noise is finite.
"""

from __future__ import annotations

import torch

from . import TRITON_AVAILABLE

MASK32 = 0xFFFFFFFF
GOLDEN32 = 0x9E3779B1
FMIX_C1 = 0x85EBCA6B
FMIX_C2 = 0xC2B2AE35


def fmix32(h: torch.Tensor) -> torch.Tensor:
    """MurmurHash3 finalizer on int64 tensors holding uint32 values."""
    h = h ^ (h >> 16)
    h = (h * FMIX_C1) & MASK32
    h = h ^ (h >> 13)
    h = (h * FMIX_C2) & MASK32
    return h ^ (h >> 16)


def row_keys(seed: torch.Tensor, counter: torch.Tensor) -> torch.Tensor:
    """Per-row hash key from an int64 seed and counter (both [N])."""
    return fmix32(((seed & MASK32) * GOLDEN32 + (counter & MASK32)) & MASK32)


def uniform_noise(seed: torch.Tensor, counter: torch.Tensor, vocab_size: int, first: int = 0) -> torch.Tensor:
    """Uniform noise in (0, 1), float32 [N, vocab_size], of token ids first, first + 1, ... (a vocabulary shard's)."""
    key = row_keys(seed.long(), counter.long())
    token_hash = fmix32(torch.arange(first, first + vocab_size, device=seed.device, dtype=torch.long))
    h = fmix32(key[:, None] ^ token_hash[None, :])
    return ((h >> 9).to(torch.float32) + 0.5) * (2.0**-23)


def gumbel_noise(seed: torch.Tensor, counter: torch.Tensor, vocab_size: int, first: int = 0) -> torch.Tensor:
    return -torch.log(-torch.log(uniform_noise(seed, counter, vocab_size, first)))


TOKEN_SALT = 0x5BD1E995  # keys the token draws apart from the Gumbel noise of the same counter


def uniform_tokens(seed: torch.Tensor, counter: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """One token id per (seed, counter) element, uniform over [0, vocab_size) up to a bias below vocab_size / 2**32
    (the 32-bit hash modulo the vocabulary); same shapes in, int64 out."""
    return fmix32(row_keys(seed.long(), counter.long()) ^ TOKEN_SALT) % vocab_size


if TRITON_AVAILABLE:
    import triton
    import triton.language as tl

    _GOLDEN32: tl.constexpr = tl.constexpr(GOLDEN32)
    _FMIX_C1: tl.constexpr = tl.constexpr(FMIX_C1)
    _FMIX_C2: tl.constexpr = tl.constexpr(FMIX_C2)

    @triton.jit
    def fmix32_tl(h):
        """fmix32 on tl.uint32 values (wrapping multiplies, logical shifts)."""
        h = h ^ (h >> 16)
        h = h * _FMIX_C1
        h = h ^ (h >> 13)
        h = h * _FMIX_C2
        return h ^ (h >> 16)

    @triton.jit
    def row_key_tl(seed, counter):
        """row_keys for one row: int64 seed and counter scalars -> tl.uint32 key."""
        return fmix32_tl(seed.to(tl.uint32) * _GOLDEN32 + counter.to(tl.uint32))

    @triton.jit
    def uniform_noise_tl(key, token):
        """uniform_noise for one row's key at int32 token ids: float32 in (0, 1), bit-identical to the torch code."""
        h = fmix32_tl(key ^ fmix32_tl(token.to(tl.uint32)))
        return ((h >> 9).to(tl.float32) + 0.5) * (2.0**-23)
