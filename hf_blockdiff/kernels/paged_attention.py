"""Paged attention with per-query key limits, GQA-aware, reading K/V straight from the page pool.

Query (r, i) attends to keys [q_start[r, i], q_limit[r, i]) of row r (q_start: 0 when not given; sliding-window
layers pass their window's first key). Block-causal windows, staircase prefills and bidirectional attention are all
expressed through these limits, so no [W, L] mask is ever built.
Token position p of row r lives at k_pages[page_table[r, p // page_size], p % page_size].
"""

import functools
import math

import torch

from . import TRITON_AVAILABLE, require_triton
from .compile_ahead import launch
from .dependent_launch import dependent_launch, launch_options
from .device_limits import fitting, shared_memory_limit, shrinking


def paged_attention_reference(q, k_pages, v_pages, page_table, q_limit, scale, q_start=None):
    """Per row: gather keys [0, max limit), mask with [q_start, q_limit), softmax in fp32 (fp64 for fp64 inputs).

    q [R, Hq, W, D]; k_pages, v_pages [num_pages, page_size, Hkv, D]; page_table [R, pages]; q_limit, q_start [R, W].
    Returns [R, W, Hq, D] in q's dtype; queries with limit 0 give zeros.
    """
    R, Hq, W, D = q.shape
    page_size, Hkv = k_pages.shape[1], k_pages.shape[2]
    compute = torch.promote_types(q.dtype, torch.float32)
    out = torch.zeros(R, W, Hq, D, device=q.device, dtype=compute)
    for r in range(R):
        pos = torch.arange(int(q_limit[r].max()) if W else 0, device=q.device)
        pages = page_table[r, pos // page_size].long()
        k = k_pages[pages, pos % page_size].to(compute).transpose(0, 1).repeat_interleave(Hq // Hkv, dim=0)
        v = v_pages[pages, pos % page_size].to(compute).transpose(0, 1).repeat_interleave(Hq // Hkv, dim=0)
        scores = (q[r].to(compute) @ k.transpose(1, 2)) * scale
        visible = pos[None, :] < q_limit[r][:, None]
        if q_start is not None:
            visible &= pos[None, :] >= q_start[r][:, None]
        probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1).nan_to_num(0.0)
        out[r] = (probs @ v).transpose(0, 1)
    return out.to(q.dtype)


@functools.lru_cache(maxsize=None)
def _sm_count(device_index):
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _auto_splits(programs, rows, block_d, capacity, device):
    """Split the key range only where the grid leaves the GPU short of programs (small batch, long prefix, or a
    grid of one to two programs per SM).

    Below one program per SM: at most two programs per SM in all and at most 16 splits (the best on an H100 for
    SDAR-4B decode shapes: batch 1 goes from 193 to 19 us at prefix 8192), each split of at least 128 keys, or 384
    for tiles of >= 256 (query, head) rows per KV head, whose partial states cost more to merge (H200, GPU time under
    a graph: a LLaDA-8B canvas of 384 queries 61 us in 3 splits, 19 us in one; Dream-7B's 512, 68 against 27; an
    SDAR-4B prefill chunk after 2,048 keys 44 us in 9 splits, 34 in 4). Never past two programs per SM: SDAR-8B's
    decode over two GPUs (4 KV heads, 32 slots: 128 programs; 300 keys of 512) took 15.7 us in 3 splits, 10.8 in 2.
    Wide heads merge float32 partials of 1 or 2 KiB per row: at most 3 splits for head dim 256 and 2 beyond (a
    DiffusionGemma canvas at batch 1 after 1,024 keys, H200: sliding layers 67 us unsplit, 36 us in 3 splits;
    global layers, head dim 512, 148 us unsplit, 76 us in 2 splits and 105 in 3).

    From one to two programs per SM (decode tiles of narrow heads only, where it was measured): 2 splits of at least
    512 keys, for the second wave's tail (H200, 8 KV heads, 24 slots: 143 us unsplit against 91 in 2 after 3,500
    keys, 37.4 against 28.8 after 800; 32 slots, 300 keys of 512: 16.1 unsplit, 18.0 in 2). `benchmarks/`
    `attention_splits.py` times these choices."""
    if device.type != "cuda":
        return 1
    sms = _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    if programs >= 2 * sms:
        return 1
    if programs >= sms:
        return 2 if rows < 256 and block_d < 256 and capacity >= 1024 else 1
    keys_per_split = 384 if rows >= 256 else 128
    most = 16 if block_d < 256 else 3 if block_d == 256 else 2
    return max(1, min(2 * sms // programs, capacity // keys_per_split, most))


def _dot_precision(q):
    if q.dtype == torch.bfloat16 and q.device.type == "cpu":
        return "interpret"
    return "ieee" if q.dtype == torch.float32 else "tf32"


def _block_m(rows, row_bytes, wide):
    """Query-tile rows: 128 for narrow heads, 64 up to 512 bytes a row, 32 beyond, where a [64, 512] float32
    accumulator spills registers under four warps (DiffusionGemma's global layers, batch 16 on an H100: 4.0 ms at 64
    rows, 1.2 ms at 32); `wide` tiles (`_wide_tiles`): 128 rows for heads of 512 bytes, 64 beyond, under eight
    warps."""
    if wide:
        most = 128 if row_bytes == 512 else 64
    elif rows >= 128 and row_bytes <= 256:
        most = 128
    else:
        most = 64 if row_bytes <= 512 else 32
    return min(most, max(16, triton.next_power_of_2(rows)))


def _wide_tiles(block_d, q):
    """16-bit heads of dim 256 and 512 (DiffusionGemma) where their 192 KiB of shared memory fit (Hopper; not an
    A100's 163 KiB): bigger tiles, eight warps, two stages (`_key_tiles`). The interpreter runs them too."""
    if q.element_size() != 2 or block_d not in (256, 512):
        return False
    row_bytes = block_d * q.element_size()
    widest = {"BLOCK_M": _block_m(128, row_bytes, True), **_key_tiles(128, row_bytes, True, 1)}
    limit = shared_memory_limit(q.device)
    return limit is None or _shared_bytes(widest, row_bytes) <= limit


def _key_tiles(block_m, row_bytes, wide, splits):
    """Key-tile rows, warps and pipeline stages: K and V tiles of at most 16 KiB each three stages deep (128 KiB of
    shared memory with the q tile), or for heads wider than 256 (bf16) of 32 KiB two stages deep. `wide` tiles:
    32 KiB K and V tiles two stages deep under eight warps (on an H200 a DiffusionGemma canvas's sliding layer went
    from 316 to 257 us at batch 16 against 64 query rows, four warps and three stages, and a global layer from 1,199
    to 1,118 us against 32 query rows and four warps)."""
    if wide:
        return {"BLOCK_N": 32768 // row_bytes, "num_warps": 8, "num_stages": 2}
    if block_m == 128 and row_bytes == 256 and splits == 1:
        # measured on an H200: ~10 % faster for head dim 128 on a full grid
        return {"BLOCK_N": 32, "num_warps": 4, "num_stages": 3}
    if row_bytes > 512:
        return {"BLOCK_N": max(16, 32768 // row_bytes), "num_warps": 4, "num_stages": 2}
    return {"BLOCK_N": max(16, min(64, 16384 // row_bytes)), "num_warps": 8 if block_m == 128 else 4, "num_stages": 3}


def _shared_bytes(config, row_bytes):
    """The q tile [BLOCK_M, BLOCK_D] and, num_stages deep, a K and a V tile [BLOCK_N, BLOCK_D], plus 1 KiB for the
    softmax statistics' reductions: an upper bound of what Triton 3.9 gives the kernel (compiled for sm_80 and
    sm_90: q and K/V tiles as here at two stages on sm_90, fewer K/V buffers elsewhere, at most 256 bytes more)."""
    return (config["BLOCK_M"] + 2 * config["num_stages"] * config["BLOCK_N"]) * row_bytes + 1024


@functools.lru_cache(maxsize=None)
def _configs(block_m, row_bytes, wide, splits, limit):
    """The launch's candidate configurations (`device_limits`): `_key_tiles`' choice, then fewer stages, key rows
    and query rows, and last no pipelining (float32 heads of dim 512 on a card of 99 KiB), those that fit `limit`."""
    first = {"BLOCK_M": block_m, **_key_tiles(block_m, row_bytes, wide, splits)}
    candidates = shrinking(first, (("num_stages", 2), ("BLOCK_N", 16), ("BLOCK_M", 16), ("num_stages", 1)))
    return fitting(candidates, lambda config: _shared_bytes(config, row_bytes), limit)


def paged_attention(q, k_pages, v_pages, page_table, q_limit, scale, num_splits=None, q_start=None):
    """Triton paged attention with the semantics of paged_attention_reference; returns [R, W, Hq, D].

    One launch, or two when the key range is split (flash-decoding): num_splits=None splits only when
    R * Hkv * query tiles is below the SM count, so decode at small batch with a long prefix fills the GPU;
    the second launch merges the partial softmax states. Splitting depends on shapes only (no host sync),
    so the call is CUDA-graph safe.
    """
    require_triton("paged_attention")
    R, Hq, W, D = q.shape
    page_size, Hkv = k_pages.shape[1], k_pages.shape[2]
    group = Hq // Hkv
    if q.stride(-1) != 1:
        q = q.contiguous()
    k_pages, v_pages, q_limit = k_pages.contiguous(), v_pages.contiguous(), q_limit.contiguous()
    starts = q_limit if q_start is None else q_start.to(q_limit.dtype).contiguous()  # read only with HAS_START
    out = torch.empty(R, W, Hq, D, device=q.device, dtype=q.dtype)
    if out.numel() == 0:
        return out

    block_d = max(16, triton.next_power_of_2(D))
    rows = group * W
    row_bytes, wide = block_d * q.element_size(), _wide_tiles(block_d, q)
    block_m = _block_m(rows, row_bytes, wide)
    m_tiles = triton.cdiv(rows, block_m)
    capacity = page_table.shape[1] * page_size
    splits = num_splits or _auto_splits(R * Hkv * m_tiles, rows, block_d, capacity, q.device)
    configs = _configs(block_m, row_bytes, wide, splits, shared_memory_limit(q.device))
    overlap = dependent_launch(q.device)
    if splits > 1:
        part_o = torch.empty(splits, R, W, Hq, D, device=q.device, dtype=torch.float32)
        part_ml = torch.empty(splits, R, W, Hq, 2, device=q.device, dtype=torch.float32)
    else:
        part_o = part_ml = out

    launch(_paged_attention_kernel, lambda config: (triton.cdiv(rows, config["BLOCK_M"]), R * Hkv, splits),
        q, k_pages, v_pages, page_table, q_limit, starts, out, part_o, part_ml,
        q.stride(0), q.stride(1), q.stride(2),
        k_pages.stride(0), k_pages.stride(1), k_pages.stride(2),
        page_table.stride(0), q_limit.stride(0), q_limit.stride(1),
        W, Hkv, triton.cdiv(capacity, splits), scale * math.log2(math.e),
        GROUP=group, PAGE_SIZE=page_size, HEAD_DIM=D, BLOCK_D=block_d,
        SPLIT=splits > 1, DOT_PRECISION=_dot_precision(q), HAS_START=q_start is not None, GDC=overlap,
        configs=configs, **launch_options(overlap),
    )
    if splits > 1:
        launch(_merge_splits_kernel, (R * W * Hq,),
            part_o, part_ml, out, R * W * Hq,
            HEAD_DIM=D, BLOCK_D=block_d, SPLITS=splits, BLOCK_S=triton.next_power_of_2(splits), GDC=overlap,
            **launch_options(overlap),
        )
    return out


if TRITON_AVAILABLE:
    import triton
    import triton.language as tl

    from .dependent_launch import follow_previous

    @triton.jit
    def _dot(a, b, acc, PRECISION: tl.constexpr):
        if PRECISION == "interpret":  # Triton's CPU interpreter multiplies the bit patterns of bf16 operands
            out = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        else:
            out = tl.dot(a, b, acc, input_precision=PRECISION)
        return out

    @triton.jit
    def _paged_attention_kernel(
        q_ptr, k_ptr, v_ptr, pt_ptr, lim_ptr, start_ptr, out_ptr, part_o_ptr, part_ml_ptr,
        s_qr, s_qh, s_qw,
        s_kp, s_ks, s_kh,
        s_pt, s_lr, s_lw,
        W, Hkv, split_keys, qk_scale,
        GROUP: tl.constexpr, PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr,
        HAS_START: tl.constexpr, GDC: tl.constexpr,
    ):
        # Tile rows are (query, head-in-group) pairs, m = w * GROUP + g, all sharing KV head hkv.
        follow_previous(GDC)
        pid_m, pid_rh, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        r, hkv = pid_rh // Hkv, pid_rh % Hkv
        Hq = Hkv * GROUP
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n, offs_d = tl.arange(0, BLOCK_N), tl.arange(0, BLOCK_D)
        w, head = offs_m // GROUP, hkv * GROUP + offs_m % GROUP
        row_ok = w < W
        d_ok = offs_d < HEAD_DIM

        lim = tl.load(lim_ptr + r * s_lr + w * s_lw, mask=row_ok, other=0)
        q = tl.load(
            q_ptr + r.to(tl.int64) * s_qr + head[:, None] * s_qh + w[:, None] * s_qw + offs_d[None, :],
            mask=row_ok[:, None] & d_ok[None, :], other=0.0,
        )
        lo, hi, first = _key_range(start_ptr + r * s_lr + w * s_lw, lim, row_ok, split, split_keys,
                                   BLOCK_M, BLOCK_N, HAS_START)
        pt_row = pt_ptr + r * s_pt
        kv_head = hkv * s_kh + offs_d[None, :]

        m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for start in range(lo, hi, BLOCK_N):
            n = start + offs_n
            n_ok = n < hi
            page = tl.load(pt_row + n // PAGE_SIZE, mask=n_ok, other=0).to(tl.int64)
            kv_off = page[:, None] * s_kp + (n % PAGE_SIZE)[:, None] * s_ks + kv_head
            kv_mask = n_ok[:, None] & d_ok[None, :]
            k = tl.load(k_ptr + kv_off, mask=kv_mask, other=0.0)
            v = tl.load(v_ptr + kv_off, mask=kv_mask, other=0.0)
            s = _dot(q, tl.trans(k), tl.zeros([BLOCK_M, BLOCK_N], tl.float32), DOT_PRECISION) * qk_scale
            visible = n_ok[None, :] & (n[None, :] < lim[:, None]) & (n[None, :] >= first[:, None])  # n_ok: lo may
            s = tl.where(visible, s, float("-inf"))  # be off the BLOCK_N grid, so a tile can cross the split's end
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.exp2(s - m_new[:, None])
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = _dot(p.to(v.dtype), v, acc * alpha[:, None], DOT_PRECISION)
            m_i = m_new

        o_row = (r * W + w).to(tl.int64) * Hq + head
        _store_tile(acc, m_i, l_i, out_ptr, part_o_ptr, part_ml_ptr, o_row,
                    split * (tl.num_programs(1) * W * GROUP).to(tl.int64),
                    row_ok, d_ok, offs_d, HEAD_DIM, SPLIT)

    @triton.jit
    def _key_range(start_ptrs, lim, row_ok, split, split_keys, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   HAS_START: tl.constexpr):
        """The tile's keys [lo, hi) in its split (whole key tiles of split_keys) and each row's first visible key."""
        split_len = tl.cdiv(split_keys, BLOCK_N) * BLOCK_N
        lo = split * split_len
        hi = tl.minimum(lo + split_len, tl.max(lim, 0))
        first = tl.zeros([BLOCK_M], tl.int32)
        if HAS_START:  # sliding-window rows: keys before the tile's earliest window start are skipped, not read
            first = tl.load(start_ptrs, mask=row_ok, other=0)
            lo = tl.maximum(lo, tl.min(tl.where(row_ok, first, hi), 0))
        return lo, hi, first

    @triton.jit
    def _store_tile(acc, m_i, l_i, out_ptr, part_o_ptr, part_ml_ptr, o_row, split_base, row_ok, d_ok, offs_d,
                    HEAD_DIM: tl.constexpr, SPLIT: tl.constexpr):
        """The finished tile: normalized into the output, or, split over the key range, raw with its max and sum for
        the merge kernel."""
        if SPLIT:
            part = split_base + o_row
            tl.store(part_o_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=row_ok[:, None] & d_ok[None, :])
            tl.store(part_ml_ptr + part * 2, m_i, mask=row_ok)
            tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=row_ok)
        else:
            o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
            tl.store(
                out_ptr + o_row[:, None] * HEAD_DIM + offs_d[None, :], o.to(out_ptr.dtype.element_ty),
                mask=row_ok[:, None] & d_ok[None, :],
            )

    @triton.jit
    def _merge_splits_kernel(
        part_o_ptr, part_ml_ptr, out_ptr, rows,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, SPLITS: tl.constexpr, BLOCK_S: tl.constexpr,
        GDC: tl.constexpr,
    ):
        follow_previous(GDC)
        row = tl.program_id(0).to(tl.int64)
        offs_s = tl.arange(0, BLOCK_S)
        offs_d = tl.arange(0, BLOCK_D)
        s_ok = offs_s < SPLITS
        part = offs_s.to(tl.int64) * rows + row
        m = tl.load(part_ml_ptr + part * 2, mask=s_ok, other=-1.0e30)
        l = tl.load(part_ml_ptr + part * 2 + 1, mask=s_ok, other=0.0)
        o = tl.load(
            part_o_ptr + part[:, None] * HEAD_DIM + offs_d[None, :],
            mask=s_ok[:, None] & (offs_d < HEAD_DIM)[None, :], other=0.0,
        )
        weight = tl.exp2(m - tl.max(m, 0))
        total = tl.sum(l * weight, 0)
        merged = tl.sum(o * weight[:, None], 0) / tl.where(total > 0, total, 1.0)
        tl.store(out_ptr + row * HEAD_DIM + offs_d, merged.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)
