"""A rank that fails while a tensor-parallel group decodes makes the others raise, not hang in a collective: two CPU
processes (gloo) launched without torchrun, whose agent would tear the survivor down itself; rank 1 fails in the
middle of a forward (tests/failing_rank_worker.py) by an uncaught exception or by being killed, and rank 0's call
raises within seconds. On GPUs (NCCL) a dead peer leaves the survivor waiting until the process group's timeout, when
NCCL's watchdog ends it; our one-shot sum traps after `weights.all_reduce.PEER_WAIT_S` (docs/architecture.md,
"Errors")."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import free_port, on_python_path
from test_distributed import CPU_ONLY

BOUND_S = 120  # the whole launch; rank 0 must raise far sooner (it reports how long it took)


@pytest.mark.parametrize("mode", ["raise", "exit"])
def test_a_failing_rank_makes_the_other_raise(checkpoint, mode):
    worker, port = Path(__file__).parent / "failing_rank_worker.py", free_port()
    processes = []
    for rank in range(2):
        env = on_python_path({**CPU_ONLY, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
                              "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)},
                             Path(__file__).parent)
        processes.append(subprocess.Popen([sys.executable, str(worker), str(checkpoint), mode], env=env,
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    try:
        outputs = [p.communicate(timeout=BOUND_S) for p in processes]
    finally:
        for p in processes:
            p.kill()
    failed, survivor = processes[1].returncode, processes[0].returncode
    assert failed == (3 if mode == "exit" else 1), outputs[1][1][-2000:]
    assert survivor == 1, outputs[0][1][-2000:]  # rank 0 raised out of its call
    stderr = outputs[0][1]
    assert re.search(r"Connection (closed|reset) by peer|Broken pipe", stderr), stderr[-2000:]  # gloo: a dead peer
    seconds = float(stderr.split("rank 0 left its call after ")[1].split(" s")[0])
    assert seconds < 30, stderr[-2000:]
