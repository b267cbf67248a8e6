"""The compile worker (fusion/compile_worker.py, fusion/compile_server.py): inputs reach it as what a trace reads of them, and a worker that
dies leaves its jobs to the decoding process, which says so and compiles them itself. The bookkeeping compiled by a
real worker while the decoding process runs it eager: tests/test_precompiled_bookkeeping.py (and tests/test_gpu.py
under CUDA graphs)."""

import io
import queue
from types import SimpleNamespace

import pytest
import torch

from hf_blockdiff.fusion import ahead_of_time, compile_server, compile_worker


def test_inputs_travel_as_what_a_trace_reads():
    base = torch.arange(12, dtype=torch.float32)
    on_meta = torch.empty(4, 6, device="meta").t()
    holder = SimpleNamespace(view=base[2:10].view(2, 4), base=base, ints=torch.tensor([3, 1]), meta=on_meta,
                             weight=torch.nn.Parameter(torch.ones(2)), value=0.5,
                             frozen=torch.nn.Parameter(torch.ones(2), requires_grad=False))
    args, kwargs, on_gpu = compile_server.unpickle_inputs(compile_worker.pickle_inputs((holder, 7), {"flag": True}))
    got = args[0]
    assert args[1] == 7 and kwargs == {"flag": True} and got.value == 0.5 and not on_gpu
    for name in ("view", "base", "ints", "meta", "weight", "frozen"):
        sent, arrived = getattr(holder, name), getattr(got, name)
        assert (type(arrived), arrived.shape, arrived.stride(), arrived.storage_offset(), arrived.dtype,
                arrived.device, arrived.requires_grad) == (type(sent), sent.shape, sent.stride(),
                                                           sent.storage_offset(), sent.dtype, sent.device,
                                                           sent.requires_grad), name
    assert torch.equal(got.view, holder.view) and torch.equal(got.ints, holder.ints)  # CPU values travel
    assert got.view.untyped_storage().data_ptr() == got.base.untyped_storage().data_ptr()  # views still alias
    assert got.meta.device.type == "meta"
    with pytest.raises(TypeError, match="plain tensors"):
        compile_worker.pickle_inputs((torch.Tensor._make_subclass(_Marked, torch.ones(2)),), {})


class _Marked(torch.Tensor):
    pass


def test_a_first_run_that_fails_only_says_so():
    x = torch.zeros(3)
    assert compile_server._first_run(_double, (x,), {})
    assert not compile_server._first_run(lambda x: x[torch.tensor([5])], (x,), {})  # out of range, as on zeros


def _double(x):
    return x * 2


def test_a_worker_that_dies_leaves_its_jobs_to_this_process(tmp_path, monkeypatch):
    worker = compile_worker.Worker()
    monkeypatch.setattr(ahead_of_time, "WORKER", worker)
    compiled = []
    monkeypatch.setattr(ahead_of_time.AheadOfTime, "_compile", lambda self, args, kwargs: compiled.append(args) or
                        SimpleNamespace(disable_guard_check=lambda: None, guard_check=lambda *a: True))
    monkeypatch.setattr(ahead_of_time.AheadOfTime, "_save", lambda *args: True)
    ahead = ahead_of_time.AheadOfTime("double", _double, "tests", globals(), in_worker=True)
    ahead_of_time.use_directory(tmp_path, in_worker=True)
    x = torch.arange(4.0)
    assert ahead.variant("key", (x,), {}) is ahead_of_time.EAGER and worker.tickets and not compiled
    assert ahead.variant("key", (x,), {}) is ahead_of_time.EAGER  # one job, still running
    worker.process.kill()
    assert worker.settle(30) and worker.landed == 1
    with pytest.warns(UserWarning, match=r"double was not compiled by the compile worker \(the compile worker "
                                         r"exited \(code -9\)\); it compiles in this process"):
        assert ahead.variant("key", (x,), {}) is not None
    assert len(compiled) == 1 and compiled[0][0] is x


def test_settle_returns_at_once_with_nothing_pending_and_waits_no_longer_than_told():
    worker = compile_worker.Worker()
    assert worker.settle(0)
    worker.tickets[1] = compile_worker.Ticket()  # a job that never finishes
    assert not worker.settle(0.05)


def test_jobs_are_published_together_once_none_is_pending():
    """A process recaptures its graphs when jobs land (`landed`): jobs landing one by one are published at once."""
    worker = compile_worker.Worker()
    first, second = worker.tickets[1], worker.tickets[2] = compile_worker.Ticket(), compile_worker.Ticket()
    worker._finish([1], None)
    assert not first.done and worker.landed == 0
    worker._finish([2], "failed")
    assert first.done and second.done and worker.landed == 2
    assert first.error is None and second.error == "failed"


def test_a_worker_that_left_idle_as_jobs_came_is_replaced_and_one_that_failed_fails_them(monkeypatch):
    """The worker exits after compile_server.IDLE_S without a job (code 0): jobs sent meanwhile go to a new one. Any
    other exit fails the pending jobs."""
    worker = compile_worker.Worker()
    started = []
    monkeypatch.setattr(worker, "_start", lambda: started.append(1) or setattr(worker, "outbox", queue.SimpleQueue()))
    for code in (0, 9):
        worker.tickets[1] = ticket = compile_worker.Ticket(job="a job")
        exited = SimpleNamespace(stdout=io.BytesIO(b""), wait=lambda code=code: code)
        worker._read(exited, queue.SimpleQueue())
        if code == 0:
            assert started == [1] and worker.outbox.get_nowait() == (1, "a job") and not ticket.done
        else:
            assert started == [1] and ticket.done and ticket.error == "the compile worker exited (code 9)"
