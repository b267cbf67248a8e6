"""Captures run with the cyclic garbage collector paused (generation/graphs.py, `capturing`): a collection inside a
capture could free an earlier engine's graphs, whose reset a capture forbids."""

import gc
import os
import threading

import pytest
import torch

from hf_blockdiff.generation.graphs import capturing, paused_gc


@pytest.fixture
def collector_on():
    was = gc.isenabled()
    gc.enable()
    yield
    (gc.enable if was else gc.disable)()


def paused_in_another_thread():
    """A thread inside `paused_gc` until the returned event is set: (the thread, that event)."""
    entered, release = threading.Event(), threading.Event()

    def other():
        with paused_gc():
            entered.set()
            release.wait(10)

    thread = threading.Thread(target=other)
    thread.start()
    assert entered.wait(10)
    return thread, release


def test_the_collector_is_off_inside_and_back_after(collector_on):
    with paused_gc():
        assert not gc.isenabled()
        with paused_gc():
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(KeyError), paused_gc():
        raise KeyError("inside")
    assert gc.isenabled()


def test_a_collector_that_was_off_stays_off(collector_on):
    gc.disable()
    with paused_gc():
        assert not gc.isenabled()
    assert not gc.isenabled()


def test_threads_overlapping_leave_it_on_only_when_the_last_leaves(collector_on):
    with paused_gc():
        thread, release = paused_in_another_thread()
    assert not gc.isenabled()  # the other thread is still inside
    release.set()
    thread.join(10)
    assert gc.isenabled()


def test_captures_run_with_the_collector_off(collector_on, monkeypatch):
    """`capturing` around torch.cuda.graph (stubbed here: no GPU), and no capture in the package outside it."""
    import contextlib
    import inspect
    import pathlib

    seen = []

    @contextlib.contextmanager
    def graph(cuda_graph, **kwargs):
        seen.append((cuda_graph, kwargs, gc.isenabled()))
        yield

    monkeypatch.setattr(torch.cuda, "graph", graph)
    with capturing("g", pool="p"):
        assert not gc.isenabled()
    assert seen == [("g", {"pool": "p"}, False)] and gc.isenabled()
    from hf_blockdiff.generation import graphs

    lines, start = inspect.getsourcelines(graphs.capturing.__wrapped__)
    package = pathlib.Path(graphs.__file__).parents[1]
    direct = [(path.name, number) for path in package.rglob("*.py")
              for number, line in enumerate(path.read_text().splitlines(), 1) if "torch.cuda.graph(" in line]
    assert direct and all(name == "graphs.py" and start <= number < start + len(lines) for name, number in direct)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="os.fork: POSIX only")
def test_a_child_forked_during_a_capture_has_its_collector_back(collector_on):
    thread, release = paused_in_another_thread()
    pid = os.fork()
    if pid == 0:  # the child: no capture under way, the collector on again and pausable
        ok = gc.isenabled()
        with paused_gc():
            ok = ok and not gc.isenabled()
        os._exit(0 if ok and gc.isenabled() else 1)
    release.set()
    thread.join(10)
    assert os.waitpid(pid, 0)[1] == 0 and gc.isenabled()


class _Cycle:
    """An object in a reference cycle (freed only by a collection) holding a captured graph."""

    def __init__(self, graph):
        self.graph, self.me = graph, self


@pytest.mark.gpu
def test_a_capture_survives_earlier_graphs_becoming_garbage(collector_on):
    """Graphs left in reference cycles, and inside the capture a collector set to run at every allocation: a plain
    capture would collect them there (their reset invalidates it); `capturing` leaves them for after."""
    x = torch.zeros(4, device="cuda")
    for _ in range(4):
        graph = torch.cuda.CUDAGraph()
        with capturing(graph):
            x.add_(1)
        _Cycle(graph)
    del graph
    thresholds = gc.get_threshold()
    try:
        graph = torch.cuda.CUDAGraph()
        with capturing(graph):
            gc.set_threshold(1, 1, 1)
            x.mul_(2)
            junk = [[object()] for _ in range(1000)]  # allocations that would start a collection
        del junk
    finally:
        gc.set_threshold(*thresholds)
    gc.collect()
    x.fill_(1)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(x, torch.full_like(x, 2.0))
