"""Portable compile caches (integrations/compile_cache.py): artifacts saved per model and environment, loaded by a
fresh process; an unreadable, unwritable, damaged or foreign directory is a warning and a cold start."""

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch

from hf_blockdiff.cli import main
from hf_blockdiff.fusion import ahead_of_time
from hf_blockdiff.integrations import compile_cache

from helpers import tiny_model


@pytest.fixture(autouse=True)
def triton_cache(tmp_path, monkeypatch):
    """`load` points Triton's cache into the directory for the whole process: here, for this test only."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton-of-this-test"))


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen3")


@pytest.fixture(scope="module")
def compiled():
    """Something this process compiled, so there are artifacts to save."""
    function = torch.compile(lambda x: x.sin() * 2 + 1)
    return function(torch.ones(3))


def test_saved_artifacts_load_in_a_fresh_process(model, compiled, tmp_path):
    path = compile_cache.save(model, tmp_path)
    assert path == compile_cache.cache_file(model, tmp_path) and path.stat().st_size > 0
    assert json.loads(path.with_suffix(".json").read_text()) == compile_cache.environment()
    code = textwrap.dedent(f"""
        import torch, sys
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        from helpers import tiny_model
        from hf_blockdiff.integrations import compile_cache
        print(compile_cache.load(tiny_model("qwen3"), {str(tmp_path)!r}))""")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert loaded.stdout.split()[-1] == "True"


def test_the_key_follows_shapes_and_dtype(model, tmp_path):
    other = tiny_model("qwen3", hidden_size=32)
    assert compile_cache.model_key(model) != compile_cache.model_key(other)
    assert compile_cache.model_key(model) != compile_cache.model_key(tiny_model("qwen3").to(torch.bfloat16))
    assert compile_cache.model_key(model) == compile_cache.model_key(tiny_model("qwen3", seed=5))  # weights aside


def test_another_environment_warns_and_starts_cold(model, compiled, tmp_path):
    path = compile_cache.save(model, tmp_path)
    sidecar = path.with_suffix(".json")
    foreign = tmp_path / f"{compile_cache.model_key(model)}-0000000000000000.json"
    foreign.write_text(json.dumps({**compile_cache.environment(), "torch": "2.0.0"}))
    path.unlink()
    sidecar.unlink()
    expected = re.escape(f"another environment (torch 2.0.0 there, {torch.__version__} here)")
    with pytest.warns(UserWarning, match=expected):
        assert compile_cache.load(model, tmp_path) is False


def test_a_damaged_file_or_a_directory_that_is_not_one_warns(model, compiled, tmp_path):
    compile_cache.cache_file(model, tmp_path).write_bytes(b"not artifacts")
    with pytest.warns(UserWarning, match="not loadable"):
        assert compile_cache.load(model, tmp_path) is False
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    with pytest.warns(UserWarning, match="not writable"):
        assert compile_cache.save(model, blocked) is None
    assert compile_cache.load(model, tmp_path / "missing") is False  # nothing there yet: no warning


def test_a_list_of_artifacts_used_that_is_damaged_or_foreign_loads_nothing(model, compiled, tmp_path):
    """`load` reads the artifacts compiled ahead of time that the last process looked up (`used_file`): a damaged
    list, or an entry that names another package's module or a path out of its folder, warns and loads nothing (no
    file read, removed or imported); a `used/` that cannot be written still saves torch's artifacts."""
    listed = compile_cache.used_file(model, tmp_path / "cache")
    listed.parent.mkdir(parents=True)
    outside = tmp_path / "plan-0123456789abcdef-0.bin"
    outside.write_bytes(b"would be unpickled, then removed as damaged")
    entry = {"folder": "bookkeeping", "name": "plan", "key": "0123456789abcdef", "module": "hf_blockdiff.scheduler"}
    foreign = [{**entry, "module": "os"}, {**entry, "folder": ".."}, {**entry, "name": "../../plan"},
               {**entry, "key": "*"}, {**entry, "extra": ""}]
    for damaged in ["{not json", json.dumps({"folder": "bookkeeping"}), *(json.dumps([e]) for e in foreign)]:
        listed.write_text(damaged)
        with pytest.warns(UserWarning, match="list of artifacts used cannot be read"):
            compile_cache.load(model, tmp_path / "cache")
    assert outside.exists()
    listed.unlink()
    listed.parent.rmdir()
    listed.parent.write_text("a file where the list's folder goes")
    with pytest.warns(UserWarning, match="list of artifacts used is not writable"):
        assert compile_cache.save(model, tmp_path / "cache") == compile_cache.cache_file(model, tmp_path / "cache")


def test_the_directory_keeps_the_newest_files(model, compiled, tmp_path):
    for index in range(compile_cache.MAX_FILES + 4):
        old = tmp_path / f"old{index}.bin"
        old.write_bytes(b"x")
        os.utime(old, (index, index))
    path = compile_cache.save(model, tmp_path)
    kept = sorted(p.name for p in tmp_path.glob("*.bin"))
    assert len(kept) == compile_cache.MAX_FILES and path.name in kept and "old0.bin" not in kept


def test_tritons_cache_in_the_directory_keeps_its_newest_kernels(model, compiled, tmp_path, monkeypatch):
    monkeypatch.setattr(compile_cache, "MAX_TRITON_BYTES", 250)
    for index in range(5):  # 100 bytes a kernel folder, the oldest first
        folder = tmp_path / "triton" / f"kernel{index}"
        folder.mkdir(parents=True)
        (folder / "kernel.cubin").write_bytes(b"x" * 100)
        os.utime(folder, (index, index))
    compile_cache.save(model, tmp_path)
    assert sorted(p.name for p in (tmp_path / "triton").iterdir()) == ["kernel3", "kernel4"]


def test_warmup_decodes_each_batch_size_then_saves(model, compiled, tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(model, "generate_multi_block", lambda ids, config: calls.append(tuple(ids.shape)))
    path = compile_cache.warmup(model, tmp_path, batch_sizes=(1, 3), prompt_len=5)
    assert calls == [(1, 5), (3, 5)] and path.exists()
    with pytest.raises(ValueError, match=r"batch_sizes=\(0,\)"):
        compile_cache.warmup(model, tmp_path, batch_sizes=(0,))


def test_the_warmup_command(tmp_path, capsys):
    args = ["warmup", "--cache-dir", str(tmp_path), "--shape", "tiny", "--batch-sizes", "1,2", "--prompt-len", "6",
            "--new-tokens", "4", "--device", "cpu", "--dtype", "float32"]
    assert main(args) == 0
    assert capsys.readouterr().out.startswith(("compile artifacts saved to", "nothing was compiled"))
    with pytest.raises(SystemExit):
        main([*args[:5], "--batch-sizes", "0,2"])
    assert "pass positive batch sizes" in capsys.readouterr().err


def test_warmup_decodes_the_config_a_bench_with_its_flags_decodes(tmp_path, monkeypatch):
    """The bookkeeping's artifacts are kept per decode config: `warmup` saves what `bench --compile-cache` with the
    same decode flags and --new-tokens loads."""
    from hf_blockdiff.cli import build_parser
    from hf_blockdiff.tools import warmup
    from hf_blockdiff.tools.bench_models import build_model
    from hf_blockdiff.tools.decode_flags import decode_config

    warmed = []
    monkeypatch.setattr(warmup.compile_cache, "warmup", lambda model, *args: warmed.append((model, args[-1])))
    flags = ["--shape", "tiny", "--new-tokens", "8", "--block-size", "8", "--strategy", "entropy_threshold",
             "--device", "cpu", "--dtype", "float32"]
    assert main(["warmup", "--cache-dir", str(tmp_path), *flags]) == 0
    ((_, config),) = warmed
    bench = decode_config(build_parser().parse_args(["bench", *flags]), build_model("tiny", None, "cpu",
                                                                                      torch.float32))
    assert repr(config) == repr(bench)
    assert (config.block_size, config.strategy, config.max_new_tokens) == (8, "entropy_threshold", 8)


def test_triton_caches_into_the_directory_unless_told_otherwise(model, tmp_path, monkeypatch):
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    compile_cache.load(model, tmp_path)
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path.resolve() / "triton")
    monkeypatch.setenv("TRITON_CACHE_DIR", "/elsewhere")
    compile_cache.load(model, tmp_path)
    assert os.environ["TRITON_CACHE_DIR"] == "/elsewhere"


def test_triton_assembles_with_the_ptxas_of_inductors_workers(model, tmp_path, monkeypatch):
    """A kernel a warmup compiled in inductor's workers (torch's ptxas) is found by a later process that compiles it
    in its main process: `load` gives the process the workers' ptxas, through torch's own helper."""
    tasks = pytest.importorskip("torch._inductor.runtime.compile_tasks")
    monkeypatch.setenv("TRITON_PTXAS_PATH", "unset below, restored after the test")
    monkeypatch.delenv("TRITON_PTXAS_PATH")
    monkeypatch.setattr(tasks, "_set_triton_ptxas_path", lambda: os.environ.setdefault("TRITON_PTXAS_PATH", "torch's"),
                        raising=hasattr(tasks, "_set_triton_ptxas_path"))
    compile_cache.load(model, tmp_path)
    assert os.environ["TRITON_PTXAS_PATH"] == "torch's"


def test_load_leaves_what_the_directory_lacks_to_the_worker_and_warmup_does_not(model, tmp_path, monkeypatch, capsys):
    """`load` turns the compile worker on (fusion/compile_worker.py) unless told not to; `warmup` compiles in its own
    process; `bench --compile-cache` waits for the worker after its first call, then times a call that captures the
    graphs again, and reports both (nothing compiles on the CPU by default: no job)."""
    compile_cache.load(model, tmp_path)
    assert ahead_of_time._in_worker
    compile_cache.load(model, tmp_path, background=False)
    assert not ahead_of_time._in_worker
    asked = []
    monkeypatch.setattr(ahead_of_time, "use_directory", lambda path, in_worker=False: asked.append(in_worker))
    monkeypatch.setattr(model, "generate_multi_block", lambda ids, config: None)
    compile_cache.warmup(model, tmp_path, batch_sizes=(1,), prompt_len=5)
    assert asked == [False]
    monkeypatch.undo()
    code = main(["bench", "--shape", "tiny", "--batch-size", "2", "--prompt-len", "9", "--new-tokens", "8", "--device",
                 "cpu", "--dtype", "float32", "--skip-reference", "--json", "--compile-cache", str(tmp_path)])
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    background = report["compile_cache"]["background_compile"]
    assert code == 0 and background["jobs"] == 0 and background["settled"]
    assert background["next_call"]["name"] == "hf_blockdiff (after the worker)"
