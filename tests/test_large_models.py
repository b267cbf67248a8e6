"""Models larger than one GPU (docs/architecture.md, "Around the loop"): no process ever holds the whole model. A
sharded LLaDA2 checkpoint loads each process's shards only and random weights are initialized per shard (one
`torchrun` of 2 CPU processes, gloo, sharded_worker.py); the bytes per GPU are reckoned, and a model that cannot split
evenly or does not fit is refused, before anything is built."""

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from hf_blockdiff.integrations.distributed import check_layout
from hf_blockdiff.model_patches.llada2 import LLaDA2MoeModelLM
from hf_blockdiff.tools.bench_models import shape_config
from hf_blockdiff.weights.shard_layout import check_fits, check_shards, shard_layout
from hf_blockdiff.weights.sharding import meta_model

from test_distributed import torchrun

SPLIT = {  # LLaDA2's tp_plan splits the MLPs, experts and LM head (whole shape, one process's)
    "model.layers.0.mlp.gate_proj.weight": ([128, 64], [64, 64]),
    "model.layers.0.mlp.down_proj.weight": ([64, 128], [64, 64]),
    "model.layers.1.mlp.experts.gate_up_proj": ([8, 64, 64], [8, 32, 64]),
    "model.layers.1.mlp.experts.down_proj": ([8, 64, 32], [8, 64, 16]),
    "model.layers.1.mlp.shared_experts.up_proj.weight": ([32, 64], [16, 64]),
    "lm_head.weight": ([157184, 64], [78592, 64]),
}
KEPT = ["model.word_embeddings.weight", "model.layers.1.attention.query_key_value.weight",
        "model.layers.1.mlp.gate.weight", "model.norm.weight"]


@pytest.fixture(scope="module")
def sharded_checkpoint(tmp_path_factory):
    """llada2-tiny (bench's shape) saved in several safetensors files, its logits spread (no near ties)."""
    config = shape_config("llada2-tiny")
    config.initializer_range = 0.5
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("llada2-tiny-sharded")
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path, max_shard_size="20MB")
    assert len(list(path.glob("*.safetensors"))) > 1
    return path


def check_weights(report: dict) -> None:
    """This process holds its slice of every split weight, every kept one whole, and no more bytes than reckoned."""
    for name, shapes in SPLIT.items():
        assert report["parameters"][name] == list(shapes)
    for name in KEPT:
        whole, local = report["parameters"][name]
        assert whole == local
    assert report["local_bytes"] == report["layout_bytes"] < 0.8 * report["whole_bytes"]


def test_no_process_holds_the_whole_model(sharded_checkpoint, tmp_path):
    output = tmp_path / "report.json"
    torchrun(Path(__file__).parent / "sharded_worker.py", sharded_checkpoint, output, timeout=300)
    reports = [json.loads(Path(f"{output}.{rank}").read_text()) for rank in range(2)]
    for report in reports:
        # a tensor of a split weight's whole shape never existed outside the meta device, while the checkpoint
        # loaded or the random weights were built; the plain load of the same checkpoint makes some (the watch works)
        assert report["loaded_seen"] == [] and report["built_seen"] == []
        assert any("(8, 64, 64)" in seen for seen in report["whole_seen"]), report["whole_seen"]
        check_weights(report["loaded"])
        check_weights(report["built"])
        # the sharded checkpoint (its experts split by transformers' MoE plan) decodes one process's tokens and
        # edits, a left-padded prompt among them
        assert report["tokens"] == report["whole_tokens"] and sum(report["tokens"]["edits"]) > 0
        # LLaDA2's fused query_key_value is kept whole, so every process caches every KV head, and its KV budget
        # reckons a token's bytes so
        assert report["cache_kv_heads"] == 2 and report["kv_bytes_per_token"] == [2 * 2 * 2 * 16 * 4] * 2
    for kind in ("loaded", "built"):  # weights kept whole agree on every process (random ones: the same seed)
        assert reports[0][kind]["kept_sums"] == reports[1][kind]["kept_sums"]


@pytest.fixture(scope="module")
def flash():
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(shape_config("llada2-flash"), dtype=torch.bfloat16)


def test_llada2_flash_bytes_per_gpu(flash):
    assert 102.8e9 < sum(p.numel() for p in flash.parameters()) < 102.9e9
    two = shard_layout(flash, 2)
    assert round(two.per_rank / 1e9, 1) == 104.8 and round(two.replicated / 1e9, 1) == 3.8
    check_fits(two, 141 * 10**9)  # an H200 holds its half
    with pytest.raises(ValueError, match=r"needs 104\.8 GB of weights per GPU with tensor_parallel_size=2 .* cuda:0 "
                       r"has 80\.0 GB free .* shard over 4 GPUs \(--tensor-parallel-size 4, torchrun "):
        check_fits(two, 80 * 10**9, "cuda:0")
    with pytest.raises(ValueError, match=r"no number of GPUs holds it"):
        check_fits(two, 4 * 10**9)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3 does not divide the weights tp_plan splits: "
                       r"model\.layers\.\*\.mlp\.experts\.gate_up_proj \(2048 along dimension 1.* divides them: 2, 4, "):
        check_shards(shard_layout(flash, 3))


def test_check_layout_before_anything_is_built():
    model = meta_model(LLaDA2MoeModelLM, shape_config("llada2-tiny"), torch.float32)
    check_layout(model, 2, "cpu")  # the CPU sets no limit
    with pytest.raises(ValueError, match=r"but cuda has 0\.0 GB free .*, or load it in bfloat16 \(--dtype bfloat16\)"):
        check_layout(model, 2, "cuda", free=10**6)
    with pytest.raises(ValueError, match="tensor_parallel_size=3 does not divide"):
        check_layout(model, 3, "cpu")
