import itertools
import math

import pytest
import torch

pytest.importorskip("triton")

from hf_blockdiff.kernels.paged_attention import paged_attention, paged_attention_reference  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16]


def make_inputs(limits, Hkv, group, head_dim, page_size, dtype, device, seed):
    """Random q and a shuffled page pool holding each row's keys [0, max limit).

    Pages no row owns and slots past a row's last key are NaN, and page-table entries past a row's last page
    are out-of-range garbage, so any read the kernel must not make shows up in the output."""
    gen = torch.Generator(device).manual_seed(seed)
    R, W = limits.shape
    row_pages = [math.ceil(int(n) / page_size) for n in limits.amax(dim=1)] if W else [0] * R
    width = max(row_pages, default=0) + 2
    num_pages = sum(row_pages) + 3
    perm = torch.randperm(num_pages, generator=gen, device=device)
    garbage = torch.randint(num_pages, num_pages + 10_000, (R, width), generator=gen, device=device)
    page_table = torch.where(torch.rand(R, width, generator=gen, device=device) < 0.5, garbage, -garbage)
    k_pages = torch.full((num_pages, page_size, Hkv, head_dim), float("nan"), device=device)
    v_pages = torch.full_like(k_pages, float("nan"))
    used = 0
    for r, n_pages in enumerate(row_pages):
        pages = perm[used : used + n_pages]
        used += n_pages
        page_table[r, :n_pages] = pages
        slots = (torch.arange(n_pages * page_size, device=device) < int(limits[r].max()))[:, None, None]
        for store in (k_pages, v_pages):
            data = torch.randn(n_pages * page_size, Hkv, head_dim, generator=gen, device=device)
            store[pages] = torch.where(slots, data, float("nan")).view(n_pages, page_size, Hkv, head_dim)
    # HF hands attention q as a transposed view of [R, W, Hq, D].
    q = torch.randn(R, W, Hkv * group, head_dim, generator=gen, device=device).transpose(1, 2)
    return q.to(dtype), k_pages.to(dtype), v_pages.to(dtype), page_table.int(), limits.int().to(device)


def window_limits(prefixes, block, num_blocks):
    """Per-query limits of a block-causal window of num_blocks blocks after each row's cached prefix."""
    steps = (torch.arange(block * num_blocks) // block + 1) * block
    return torch.tensor(prefixes)[:, None] + steps[None, :]


def check(limits, Hkv, group, head_dim, page_size, dtype, device, assert_close, seed, num_splits=None, starts=None):
    q, k, v, pt, lim = make_inputs(limits, Hkv, group, head_dim, page_size, dtype, device, seed)
    scale = head_dim**-0.5
    starts = None if starts is None else starts.int().to(lim.device)
    out = paged_attention(q, k, v, pt, lim, scale, num_splits=num_splits, q_start=starts)
    ref = paged_attention_reference(q.double(), k.double(), v.double(), pt, lim, scale, q_start=starts)
    assert out.shape == (q.shape[0], q.shape[2], q.shape[1], head_dim) and out.dtype == dtype and out.is_contiguous()
    assert (out[lim == 0] == 0).all()
    assert_close(out, ref, dtype)


CASES = [
    (i, group, page_size, dtype, (64, 128)[i % 2], 1 + i % 4, (4, 8)[i // 4 % 2])
    for i, (group, page_size, dtype) in enumerate(itertools.product([1, 2, 4], [16, 32, 64], DTYPES))
]


@pytest.mark.parametrize("seed,group,page_size,dtype,head_dim,num_blocks,block", CASES)
def test_ragged_block_causal_windows(
    seed, group, page_size, dtype, head_dim, num_blocks, block, device, assert_close, poisoned
):
    # Rows: long prefix, no prefix, inactive (all limits 0), prefix ending mid-page.
    limits = window_limits([70, 0, 0, 37], block, num_blocks)
    limits[2] = 0
    check(limits, 2, group, head_dim, page_size, dtype, device, assert_close, seed=seed)


@pytest.mark.parametrize("num_splits", [2, 5])
@pytest.mark.parametrize("dtype", DTYPES)
def test_split_keys(num_splits, dtype, device, assert_close, poisoned):
    limits = window_limits([300, 5, 0], 4, 2)
    limits[2] = 0
    check(limits, 2, 4, 64, 32, dtype, device, assert_close, seed=num_splits, num_splits=num_splits)


@pytest.mark.parametrize("group,length", [(1, 80), (2, 50), (4, 37)])
def test_staircase_prefill(group, length, device, assert_close, poisoned):
    # W = prompt length: block-causal in blocks of 4 from position 0, last block cut at the prompt end.
    steps = ((torch.arange(length) // 4 + 1) * 4).clamp(max=length)
    limits = torch.stack([steps, torch.full((length,), length)])  # row 1 is bidirectional
    check(limits, 2, group, 64, 16, torch.bfloat16, device, assert_close, seed=length)


@pytest.mark.parametrize("num_splits", [None, 3])
@pytest.mark.parametrize("window", [1, 5, 40])
def test_sliding_window_starts(window, num_splits, device, assert_close, poisoned):
    """Keys [q_start, q_limit): a causal sliding window (start = position - window + 1) over a long prefix, and a
    canvas row whose queries all see the last window - 1 prefix keys and the whole canvas (DiffusionGemma's decoder);
    the reference without starts differs, so ignoring them fails."""
    causal = torch.arange(1, 70)[None, :].repeat(2, 1)
    canvas = torch.full((1, 69), 50 + 19)
    limits = torch.cat([causal, canvas])
    starts = torch.cat([(causal - window).clamp(min=0), torch.full((1, 69), max(50 - window + 1, 0))])
    check(limits, 2, 2, 64, 16, torch.float32, device, assert_close, seed=window, num_splits=num_splits,
          starts=starts)
    q, k, v, pt, lim = make_inputs(limits, 2, 2, 64, 16, torch.float32, device, window)
    full = paged_attention_reference(q.double(), k.double(), v.double(), pt, lim, 0.125)
    windowed = paged_attention_reference(q.double(), k.double(), v.double(), pt, lim, 0.125,
                                        q_start=starts.int().to(lim.device))
    assert not torch.allclose(full, windowed)


@pytest.mark.parametrize("head_dim", [96, 256])
def test_padded_and_large_head_dims(head_dim, device, assert_close, poisoned):
    check(window_limits([40, 3], 4, 2), 1, 2, head_dim, 16, torch.float32, device, assert_close, seed=head_dim)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [None, 20])
def test_wide_heads_over_a_canvas(window, dtype, device, assert_close, poisoned):
    """DiffusionGemma's global layers: head dim 512, 8 query heads per KV head, a bidirectional canvas after a cached
    prefix (256 (query, head) rows per KV head); its sliding layers pass starts."""
    limits = torch.tensor([[45] * 32, [70] * 32])
    starts = None if window is None else (limits - window).clamp(min=0)
    check(limits, 2, 8, 512, 16, dtype, device, assert_close, seed=5, starts=starts)


@pytest.mark.parametrize("rows,head_dim,programs,capacity,splits", [
    (16, 128, 8, 8192, 16),  # SDAR decode at batch 1: split to fill the GPU
    (16, 128, 8, 512, 4),  # ... into splits of at least 128 keys
    (512, 128, 32, 2176, 5),  # a prefill chunk of narrow heads after 2,048 keys: splits of at least 384 keys
    (384, 128, 96, 384, 1),  # a LLaDA canvas: one split's worth of keys
    (3584, 128, 112, 512, 1),  # a Dream canvas (7 query heads per KV head)
    (512, 256, 32, 1280, 3),  # a DiffusionGemma canvas at batch 1, sliding layers: at most 3 splits
    (2048, 512, 64, 1280, 2),  # ... and global layers (head dim 512): at most 2
    (512, 256, 512, 8192, 1),  # ... at batch 16: a full grid
    (16, 128, 128, 512, 2),  # SDAR-8B decode at batch 32 over two GPUs: never past two programs per SM
    (16, 128, 192, 4096, 2),  # from one to two programs per SM: two splits for a long prefix ...
    (16, 128, 256, 512, 1),  # ... of at least 512 keys each
    (512, 128, 192, 4096, 1),  # ... in decode tiles only
    (16, 128, 264, 8192, 1),  # a full grid
])
def test_auto_splits(rows, head_dim, programs, capacity, splits, monkeypatch):
    """The split choice on a 132-SM GPU (the choice reads shapes only, so it runs without one)."""
    from hf_blockdiff.kernels import paged_attention as module

    monkeypatch.setattr(module, "_sm_count", lambda index: 132)
    assert module._auto_splits(programs, rows, head_dim, capacity, torch.device("cuda", 0)) == splits


@pytest.mark.parametrize("head_dim,dtype,shared_kib,wide", [
    (256, torch.bfloat16, 227, True), (512, torch.float16, 227, True),  # Hopper
    (256, torch.bfloat16, 164, False),  # an A100: the 192 KiB of the wide tiles would not fit
    (256, torch.float32, 227, False), (128, torch.bfloat16, 227, False),
])
def test_wide_tiles_only_where_they_fit(head_dim, dtype, shared_kib, wide):
    from types import SimpleNamespace

    from hf_blockdiff.kernels import paged_attention as module
    from hf_blockdiff.kernels.device_limits import assumed_shared_memory

    q = SimpleNamespace(device=torch.device("cuda", 0), element_size=lambda: torch.finfo(dtype).bits // 8)
    with assumed_shared_memory(shared_kib * 1024):
        assert module._wide_tiles(head_dim, q) is wide


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_single_query_decode(dtype, device, assert_close, poisoned):
    check(torch.tensor([[1], [77], [0], [16]]), 2, 4, 128, 16, dtype, device, assert_close, seed=1)


@pytest.mark.gpu
@pytest.mark.parametrize("batch,page_size,block", [(4, 16, 4), (32, 64, 4), (64, 256, 32), (4, 128, 32), (32, 32, 32)])
def test_large_shapes_gpu(batch, page_size, block, assert_close):
    gen = torch.Generator().manual_seed(batch + page_size)
    for num_blocks in range(1, 5):
        prefixes = torch.randint(0, 8193, (batch,), generator=gen)
        prefixes[0] = 0
        prefixes[-1] = 8192
        limits = window_limits(prefixes.tolist(), block, num_blocks)
        check(limits, 8, 4, 128, page_size, torch.bfloat16, "cuda", assert_close, seed=num_blocks)


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("head_dim,Hkv,window", [(256, 8, 1024), (512, 2, None)])
def test_diffusion_gemma_canvas_shapes_gpu(batch, head_dim, Hkv, window, assert_close):
    """A 256-token canvas after 1,024 cached keys in bfloat16, 16 query heads: the wide-head tiles, split in 3 (head
    dim 256) or 2 (512) at batch 1 on a GPU of 132 SMs, against the float64 reference."""
    limits = torch.full((batch, 256), 1024 + 256)
    starts = None if window is None else (torch.arange(1024, 1280) - window + 1).clamp(min=0).expand(batch, 256)
    check(limits, Hkv, 16 // Hkv, head_dim, 256, torch.bfloat16, "cuda", assert_close, seed=head_dim + batch,
          starts=starts)


def test_microbench_smoke(device):
    """`hf-blockdiff bench --kernels` on tiny shapes (the interpreter on CPU): every row is timed, nothing absent is
    invented."""
    from hf_blockdiff.tools import microbench

    rows = microbench.run(device=device, small=True)
    assert {row["kernel"] for row in rows} == {"paged_attention", "scoring T=0.0", "scoring T=1.0"}
    assert all(row["triton_us"] > 0 and row["torch_us"] > 0 for row in rows)
    if device == "cpu":
        assert all(math.isnan(row["flex_us"]) and math.isnan(row["flash_us"]) for row in rows)  # CUDA-only columns
