"""Expert parallelism (docs/architecture.md, "Around the loop"): tiny fp32 SDAR-MoE, LLaDA2 and DiffusionGemma
checkpoints with their experts split over 2 processes (CPU, gloo; attention tensor parallel) decode the tokens of one
process, in one torchrun launch (about 15 s); bad sizes are refused before anything loads."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from diffusion_gemma_models import tiny_diffusion_gemma
from expert_parallel_worker import CONFIGS, decode, experts_modules
from helpers import char_tokenizer, save_checkpoint
from released_checkpoints import llada2_config, sdar_moe_config, sharp_state, write_checkpoint

from hf_blockdiff.fusion.experts import _stock
from hf_blockdiff.integrations.checkpoint import load_pretrained
from hf_blockdiff.weights.sharding import check_sharding

# the worker's processes see no GPU (tests/test_distributed.py) and import this checkout's hf_blockdiff
ROOT = str(Path(__file__).resolve().parents[2])
CPU_ONLY = {"CUDA_VISIBLE_DEVICES": "", "TRITON_INTERPRET": "1",
            "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}


TINY_VISION = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                   num_key_value_heads=2, head_dim=8, position_embedding_size=16)


def released(directory: Path, config: dict) -> str:
    write_checkpoint(directory, config, sharp_state(config))
    char_tokenizer().save_pretrained(directory)
    return str(directory)


def diffusion_gemma(directory: Path) -> str:
    # full attention's 2 KV heads split too; a vision tower of 0.01 % of the default one (text only: unused)
    model = tiny_diffusion_gemma("mixed_moe", vision=TINY_VISION, num_global_key_value_heads=2)
    model.save_pretrained(directory)
    return str(directory)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("expert-parallel")
    return {"sdar_moe": released(root / "sdar_moe", sdar_moe_config()),
            "llada2_moe": released(root / "llada2_moe", llada2_config()),
            "diffusion_gemma": diffusion_gemma(root / "diffusion_gemma")}


def one_process(family: str, checkpoint: str) -> tuple[list, list]:
    if family == "diffusion_gemma":
        from transformers import DiffusionGemmaForBlockDiffusion

        model = DiffusionGemmaForBlockDiffusion.from_pretrained(checkpoint, dtype=torch.float32).eval()
    else:
        model = load_pretrained(checkpoint, "cpu")[0]
    return decode(model, family), experts_modules(model)


def worker(*args: str, timeout: int = 240) -> subprocess.CompletedProcess:
    """expert_parallel_worker.py under `torchrun --nproc_per_node 2`."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               str(Path(__file__).parent / "expert_parallel_worker.py"), *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env={**os.environ, **CPU_ONLY})


def test_expert_parallel_matches_one_process(checkpoints, checkpoint, tmp_path):
    report_path = tmp_path / "report.json"
    run = worker(json.dumps(checkpoints), str(checkpoint), str(report_path))
    assert run.returncode == 0, run.stderr[-3000:]
    reports = [json.loads(Path(f"{report_path}.{rank}").read_text()) for rank in range(2)]
    for family, path in checkpoints.items():
        tokens, experts = one_process(family, path)
        whole = experts[0].num_experts
        assert all(_stock(m) for m in experts)  # unsharded, the fused experts op would run them
        for report in reports:
            assert report[family]["tp_size"] == 2
            assert report[family]["local_experts"] == [whole // 2]  # whole experts, half on each process
            assert not report[family]["fused"]  # sharded experts run the model's own (expert-parallel) forward
            assert report[family]["tokens"] == tokens, family
    for report in reports:  # every process refuses, before loading, so none waits for another
        assert "model has no experts" in report["dense_error"]


def test_a_failing_process_ends_the_launch(checkpoints):
    """Rank 1 fails while rank 0 waits for it in a collective: the launch ends with rank 1's error (torchrun stops
    rank 0), it does not hang until the subprocess timeout."""
    started = time.monotonic()
    run = worker(checkpoints["sdar_moe"], timeout=120)
    assert run.returncode != 0 and "rank 1 failed on purpose" in run.stderr
    assert time.monotonic() - started < 60


@pytest.fixture
def launch_of(monkeypatch):
    """A launch of `n` processes as init_tensor_parallel sees it (nothing is initialized: every check comes first)."""
    return lambda n: monkeypatch.setenv("WORLD_SIZE", str(n))


def test_expert_parallel_sizes_are_checked_before_loading(checkpoints, checkpoint, launch_of):
    sdar = checkpoints["sdar_moe"]  # 4 experts, 4 attention heads, 2 KV heads, experts 16 wide
    launch_of(3)
    with pytest.raises(ValueError, match=r"num_experts=4 is not divisible by 3: .* dividing 4 \(e\.g\. 2, 4\)"):
        load_pretrained(sdar, "cpu", tensor_parallel_size=3, expert_parallel=True)
    with pytest.raises(ValueError, match="tensor_parallel_size=2 does not divide the launch's 3 processes"):
        load_pretrained(sdar, "cpu", tensor_parallel_size=2, expert_parallel=True)  # sizes fit; the launch does not
    launch_of(2)
    with pytest.raises(ValueError, match="the qwen3 model has no experts .* drop expert_parallel"):
        load_pretrained(str(checkpoint), "cpu", tensor_parallel_size=2, expert_parallel=True)
    with pytest.raises(ValueError, match="tensor_parallel_size=1: pass tensor_parallel_size N > 1"):
        load_pretrained(sdar, "cpu", expert_parallel=True)


def test_tensor_parallel_sizes_are_checked_before_loading(checkpoints):
    from transformers import AutoConfig

    sdar = AutoConfig.from_pretrained(checkpoints["sdar_moe"])
    with pytest.raises(ValueError, match="num_key_value_heads=2 is not divisible by 4"):
        check_sharding(sdar, 4, expert_parallel=True)
    with pytest.raises(ValueError, match="moe_intermediate_size=16 is not divisible by 3: .* expert_parallel=True"):
        check_sharding(sdar, 3, expert_parallel=False)
    gemma = AutoConfig.from_pretrained(checkpoints["diffusion_gemma"])
    check_sharding(gemma, 2, expert_parallel=True)
    gemma.text_config.num_global_key_value_heads = 1  # its full-attention layers' KV heads
    with pytest.raises(ValueError, match="num_global_key_value_heads=1 is not divisible by 2"):
        check_sharding(gemma, 2, expert_parallel=True)
    # built without layer_types, transformers keeps its KV heads per layer and refuses to read them globally
    from hf_blockdiff.tools.diffusion_gemma_bench import SHAPES

    sizes = dict(SHAPES["diffusion-gemma-tiny"][0], num_key_value_heads=1, num_global_key_value_heads=1)
    with pytest.raises(ValueError, match="num_key_value_heads=1 is not divisible by 2"):
        check_sharding(type(gemma)(text_config=sizes, vision_config={"model_type": "gemma4_vision"}), 2, True)


def test_expert_parallel_flags_are_refused_without_tensor_parallel(checkpoints, capsys):
    from hf_blockdiff.cli import main

    sdar = checkpoints["sdar_moe"]
    assert main(["generate", "--model", sdar, "--prompt", "x", "--device", "cpu", "--expert-parallel"]) == 2
    assert "tensor_parallel_size=1: pass tensor_parallel_size N > 1" in capsys.readouterr().err
    assert main(["bench", "--shape", "llada2-tiny", "--device", "cpu", "--expert-parallel"]) == 2
    assert "--expert-parallel and --tensor-parallel-size shard over the processes of --tensor-parallel" in \
        capsys.readouterr().err
    assert main(["bench", "--shape", "diffusion-gemma-tiny", "--device", "cpu", "--tensor-parallel"]) == 2
    assert "--tensor-parallel shards over the processes of a launch" in capsys.readouterr().err
