"""Which kernel sums a row-parallel layer's partial output and where (weights/all_reduce.py): the one-shot kernel's two
slots alternate and are taken only after a call every peer joins since the forward began. The kernels themselves run
on two GPUs (test_distributed.py, `test_partial_sums_on_gpus_are_exact`)."""

import torch

from hf_blockdiff.weights.all_reduce import ONE_SHOT_BYTES, TWO_SHOT_BYTES, Route, kind_of

SLOT_0, SLOT_1 = TWO_SHOT_BYTES, TWO_SHOT_BYTES + ONE_SHOT_BYTES
SMALL, MID, LARGE = 32 * 1024, 2 * ONE_SHOT_BYTES, 2 * TWO_SHOT_BYTES


def routes(route: Route, sizes, dtype=torch.bfloat16) -> list[tuple[str, int]]:
    return [route.next(size, dtype) for size in sizes]


def test_kinds_by_size_dtype_and_buffer():
    assert [kind_of(size, torch.bfloat16, True, True) for size in (SMALL, ONE_SHOT_BYTES, MID, TWO_SHOT_BYTES,
                                                                   LARGE)] == [
        "one_shot", "one_shot", "two_shot", "two_shot", "backend"]
    assert kind_of(SMALL, torch.float32, True, True) == "one_shot"
    assert kind_of(SMALL, torch.float16, True, True) == "backend"  # torch's kernels take bf16 and fp32 only
    assert kind_of(SMALL, torch.bfloat16, False, True) == "backend"  # gloo, or no symmetric memory
    assert kind_of(SMALL, torch.bfloat16, True, False) == "backend"  # unfenced
    assert kind_of(MID, torch.bfloat16, True, False) == "two_shot"


def test_one_shot_slots_alternate_after_a_fencing_call():
    route = Route(symmetric=True)
    assert routes(route, [SMALL] * 4) == [("backend", 0), ("one_shot", SLOT_0), ("one_shot", SLOT_1),
                                          ("one_shot", SLOT_0)]
    # a two-shot or backend call waits for every peer: both slots are free after it
    assert routes(route, [MID, SMALL, SMALL, LARGE, SMALL]) == [("two_shot", 0), ("one_shot", SLOT_0),
                                                                ("one_shot", SLOT_1), ("backend", 0),
                                                                ("one_shot", SLOT_0)]
    route.slot = None  # `fence`: a stack's forward begins (a CUDA graph may replay it after any call)
    assert routes(route, [SMALL, SMALL]) == [("backend", 0), ("one_shot", SLOT_0)]


def test_without_a_symmetric_buffer_every_message_takes_the_backend():
    route = Route(symmetric=False)
    assert routes(route, [SMALL, MID, SMALL]) == [("backend", 0)] * 3
    assert route.slot is None
