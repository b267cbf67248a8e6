"""Kernel microbenchmarks on SDAR-4B shapes: paged attention vs a dense SDPA reference vs the bandwidth bound,
and fused scoring vs torch. triton_us and torch_us time plain calls (host overhead included), graph_us the
Triton call replayed in a CUDA graph; bandwidth_frac = bound_us / graph_us. flex_us (with `flex=True`) times compiled
FlexAttention with a BlockMask on the same problem with K/V already dense per row: a lower bound for a flex backend,
which would also have to page. flash_us: the installed FlashAttention's paged call (FA2/FA3/FA4), in a CUDA graph.
`python -m hf_blockdiff.tools.microbench` prints the table on a CUDA device; `run(device="cpu", small=True)`
is a smoke test under TRITON_INTERPRET=1."""

import math
import time

import torch
import torch.nn.functional as F

from ..kernels import flash
from ..kernels.paged_attention import paged_attention
from ..kernels.scoring import score_reference, score_triton

HQ, HKV, HEAD_DIM, VOCAB, MASK_ID = 32, 8, 128, 151936, 151669


def time_ms(fn, device, graph=False, rep_ms=20):
    """Median milliseconds of calls repeated for about `rep_ms` each time; graph=True replays fn in a CUDA graph,
    leaving out the host's launch overhead."""
    if device == "cuda":
        import triton.testing

        if graph:
            return triton.testing.do_bench_cudagraph(fn, rep=rep_ms, return_mode="median")
        return triton.testing.do_bench(fn, rep=rep_ms, return_mode="median")
    fn()
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def _bandwidth(device, nbytes):
    """Bytes per millisecond of a device-to-device copy, counting bytes read and written."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / time_ms(lambda: dst.copy_(src), device)


def _paged_inputs(batch, prefix, block, page_size, device):
    length = prefix + block
    pages_per_row = math.ceil(length / page_size)
    pool = (batch * pages_per_row, page_size, HKV, HEAD_DIM)
    k_pages = torch.randn(pool, device=device, dtype=torch.bfloat16)
    v_pages = torch.randn(pool, device=device, dtype=torch.bfloat16)
    page_table = torch.randperm(batch * pages_per_row, device=device).view(batch, pages_per_row).int()
    q = torch.randn(batch, block, HQ, HEAD_DIM, device=device, dtype=torch.bfloat16).transpose(1, 2)
    q_limit = torch.full((batch, block), length, device=device, dtype=torch.int32)
    return q, k_pages, v_pages, page_table, q_limit


def _sdpa_reference(q, k_pages, v_pages, page_table, q_limit, scale):
    """What the sdpa backend does: gather pages into dense K/V, build a bool mask, call SDPA with GQA."""
    length = int(q_limit.max())
    page_size = k_pages.shape[1]
    pos = torch.arange(length, device=q.device)
    pages = page_table[:, pos // page_size].long()
    k = k_pages[pages, pos % page_size].transpose(1, 2)
    v = v_pages[pages, pos % page_size].transpose(1, 2)
    mask = (pos[None, :] < q_limit[:, :, None])[:, None]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)


def _flex_lower_bound_ms(q, k_pages, v_pages, page_table, q_limit, scale, device="cuda"):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    page_size = k_pages.shape[1]
    length = -(-int(q_limit.max()) // 128) * 128  # whole flex blocks; the mask hides the padding keys
    pos = torch.arange(length, device=q.device)
    pages = page_table[:, (pos // page_size).clamp(max=page_table.shape[1] - 1)].long()
    k, v = (pool[pages, pos % page_size].transpose(1, 2).contiguous() for pool in (k_pages, v_pages))
    q = q.contiguous()
    lengths = q_limit.amax(1)  # every query of a row sees the same keys here (flex pads the queries)

    def visible(b, h, q_idx, kv_idx):
        return kv_idx < lengths[b]

    mask = create_block_mask(visible, q.shape[0], None, q.shape[2], length, device=q.device)
    flex = torch.compile(flex_attention)
    flex(q, k, v, block_mask=mask, scale=scale, enable_gqa=True)  # compile outside the timed graph
    return time_ms(lambda: flex(q, k, v, block_mask=mask, scale=scale, enable_gqa=True), device, graph=True)


def _bench_attention(batch, prefix, block, page_size, device, bandwidth, flex=False):
    q, k_pages, v_pages, page_table, q_limit = _paged_inputs(batch, prefix, block, page_size, device)
    args = (q, k_pages, v_pages, page_table, q_limit, HEAD_DIM**-0.5)
    kv_bytes = 2 * batch * (prefix + block) * HKV * HEAD_DIM * 2
    io_bytes = kv_bytes + 2 * q.numel() * 2
    triton_ms = time_ms(lambda: paged_attention(*args), device)
    graph_ms = time_ms(lambda: paged_attention(*args), device, graph=True)
    try:
        sdpa_ms = time_ms(lambda: _sdpa_reference(*args), device)
    except torch.OutOfMemoryError:
        sdpa_ms = float("nan")
    flex_ms = _flex_lower_bound_ms(*args, device) if flex else float("nan")
    kernel = flash.load() if device == "cuda" else None
    flash_ms = float("nan")
    if kernel is not None:
        flash_args = (q.transpose(1, 2), k_pages, v_pages, q_limit.amax(1), page_table, HEAD_DIM**-0.5)
        kernel.run(*flash_args)  # compile (FA4) outside the timed graph
        flash_ms = time_ms(lambda: kernel.run(*flash_args), device, graph=True)
    return dict(
        kernel="paged_attention", batch=batch, prefix=prefix, block=block, page_size=page_size,
        triton_us=triton_ms * 1e3, graph_us=graph_ms * 1e3, torch_us=sdpa_ms * 1e3, flex_us=flex_ms * 1e3,
        flash_us=flash_ms * 1e3, bound_us=io_bytes / bandwidth * 1e3, bandwidth_frac=io_bytes / bandwidth / graph_ms,
    )


def _bench_scoring(n, vocab, temperature, device, bandwidth):
    logits = torch.randn(n, vocab, device=device, dtype=torch.bfloat16) * 3
    seed = torch.arange(n, device=device)
    args = (logits, MASK_ID % vocab, temperature, 0, seed, seed)
    io_bytes = logits.numel() * 2
    triton_ms = time_ms(lambda: score_triton(*args), device)
    graph_ms = time_ms(lambda: score_triton(*args), device, graph=True)
    torch_ms = time_ms(lambda: score_reference(*args), device)
    return dict(
        kernel=f"scoring T={temperature}", batch=n, prefix=0, block=0, page_size=0,
        triton_us=triton_ms * 1e3, graph_us=graph_ms * 1e3, torch_us=torch_ms * 1e3, flex_us=float("nan"),
        flash_us=float("nan"),
        bound_us=io_bytes / bandwidth * 1e3, bandwidth_frac=io_bytes / bandwidth / graph_ms,
    )


def run(device="cuda", small=False, flex=False):
    """Benchmark rows as dicts; `small` shrinks every shape so the interpreter can run it; `flex` adds the
    FlexAttention column (a compilation per shape)."""
    bandwidth = _bandwidth(device, 2**20 if small else 2**30)
    prefixes, batches, pages = ([32], [2], [16]) if small else ([512, 2048, 8192], [1, 32, 128], [64])
    rows = []
    for prefix in prefixes:
        for batch in batches:
            for block in (4, 32):
                for page_size in pages:
                    rows.append(_bench_attention(batch, prefix, block, page_size, device, bandwidth, flex))
    if not small:
        for page_size in (16, 128):
            rows.append(_bench_attention(32, 2048, 4, page_size, device, bandwidth))
    for n in [2] if small else [4, 128, 512]:
        for temperature in (0.0, 1.0):
            rows.append(_bench_scoring(n, 1000 if small else VOCAB, temperature, device, bandwidth))
    return rows


def print_table(rows):
    cols = ["kernel", "batch", "prefix", "block", "page_size", "triton_us", "graph_us", "torch_us", "flex_us",
            "flash_us", "bound_us", "bandwidth_frac"]
    print(" ".join(f"{c:>16}" for c in cols))
    for row in rows:
        print(" ".join(f"{row[c]:>16.2f}" if isinstance(row[c], float) else f"{row[c]:>16}" for c in cols))


if __name__ == "__main__":
    print_table(run())
