"""`hf-blockdiff generate` on a tiny checkpoint with a character tokenizer (in-process through `cli.main`)."""

import json

import pytest
import torch

from hf_blockdiff import BlockDiffusionConfig
from hf_blockdiff.integrations.checkpoint import load_pretrained
from hf_blockdiff.cli import main
from hf_blockdiff.integrations.completions import complete

FLAGS = ["--max-new-tokens", "8", "--threshold", "0.6", "--eos-token-id"]
CFG = BlockDiffusionConfig(max_new_tokens=8, threshold=0.6, eos_token_id=[])
PROMPTS = ["hello", "x = 1", "abc def", "Once upon a time"]


@pytest.fixture(scope="module")
def expected(checkpoint):
    model, tokenizer = load_pretrained(str(checkpoint))
    return {chat: [c.text for c in complete(model, PROMPTS, CFG, tokenizer, chat=chat)] for chat in (False, True)}


def write_jsonl(path, records):
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    return str(path)


def test_prompt_prints_the_completion(checkpoint, expected, capsys):
    assert main(["generate", "--model", str(checkpoint), "--prompt", PROMPTS[0], *FLAGS]) == 0
    out, err = capsys.readouterr()
    assert out == expected[False][0] + "\n"
    assert "generate:" not in err  # one batch: no progress bar


def test_input_jsonl_keeps_the_order(checkpoint, expected, tmp_path, capsys):
    source = write_jsonl(tmp_path / "in.jsonl", [{"prompt": p} for p in PROMPTS])
    output = tmp_path / "out.jsonl"
    argv = ["generate", "--model", str(checkpoint), "--input", source, "--output", str(output), "--batch-size", "1"]
    assert main(argv + FLAGS) == 0
    records = [json.loads(line) for line in output.read_text().splitlines()]
    assert [r["prompt"] for r in records] == PROMPTS
    assert [r["completion"] for r in records] == expected[False]
    assert "generate:" in capsys.readouterr().err  # four batches: a progress bar


def test_chat_formats_with_the_template(checkpoint, expected, tmp_path, capsys):
    records = [{"prompt": PROMPTS[0]}, {"messages": [{"role": "user", "content": PROMPTS[1]}]}]
    source = write_jsonl(tmp_path / "chat.jsonl", records)
    assert main(["generate", "--model", str(checkpoint), "--input", source, "--chat", *FLAGS]) == 0
    printed = [json.loads(line)["completion"] for line in capsys.readouterr().out.splitlines()]
    assert printed == expected[True][:2] and printed != expected[False][:2]


@pytest.mark.parametrize(
    "case,message",
    [
        ("missing-model", "is not a directory holding a checkpoint"),
        ("bad-line", "bad.jsonl:2: not a JSON object"),
        ("no-prompt", "bad.jsonl:1: each line needs a 'prompt' string or a 'messages' list"),
        ("strategy", "strategy='fastest' is invalid: choose one of"),
        ("messages-without-chat", "Chat-message prompts need chat=True (--chat)"),
    ],
)
def test_errors_are_one_line_and_exit_2(checkpoint, tmp_path, capsys, case, message):
    bad = tmp_path / "bad.jsonl"
    model, source, extra = str(checkpoint), ["--prompt", "hi"], []
    if case == "missing-model":
        model = str(tmp_path / "nowhere")
    elif case == "bad-line":
        bad.write_text('{"prompt": "ok"}\n{"prompt": oops}\n')
        source = ["--input", str(bad)]
    elif case == "no-prompt":
        bad.write_text('{"text": "hi"}\n')
        source = ["--input", str(bad)]
    elif case == "strategy":
        extra = ["--strategy", "fastest"]
    else:
        source = ["--input", write_jsonl(bad, [{"messages": [{"role": "user", "content": "hi"}]}])]
    assert main(["generate", "--model", model, *source, *extra]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[-1].startswith("hf-blockdiff: error: ") and message in err[-1]


def test_bench_reports_both_loops(capsys):
    code = main(["bench", "--shape", "tiny", "--batch-size", "2", "--prompt-len", "9", "--new-tokens", "8",
                 "--device", "cpu", "--dtype", "float32", "--json"])
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0 and [r["name"] for r in report["results"]] == ["hf_blockdiff", "reference (reference_loop)"]
    ours, reference = report["results"]
    # prefill + blocks of 3, 4, 4 masks (the first holds the prompt tail); the reference adds a store forward each
    assert ours["forwards"] == 1 + 11 and reference["forwards"] == 1 + 11 + 3
    assert ours["tokens"] == reference["tokens"] == 16 and report["speedup"] > 0
    # the process's first call (compile, capture, warm-up) is reported beside the warm one
    first = report["first_call"]
    assert first["name"] == "hf_blockdiff (first call)" and first["seconds"] > 0 and first["forwards"] == 12
    assert report["first_call_overhead_s"] == round(first["seconds"] - ours["seconds"], 3)
    # then a call of another prompt length (9 * 3 // 4 + 1 = 7) and batch size (3), and the same call warm
    new_shape = report["new_shape_call"]
    assert new_shape["name"] == "hf_blockdiff (new shape call)" and new_shape["rows"] == 3
    assert new_shape["tokens"] == 24 and new_shape["seconds"] > 0 and "new_shape_overhead_s" in report
    assert report["recompile_limits_hit"] == []


def test_a_recompile_limit_hit_is_reported():
    """The bench reports a compiled function that hit dynamo's recompile limit (it runs eager from then on), by name
    from dynamo's warning, or by count where logging hides that warning."""
    import logging

    import torch

    from hf_blockdiff.tools.measure import recompile_limits_hit

    def hit_the_limit():
        torch._dynamo.reset()
        add_one = torch.compile(lambda x: x + 1, backend="eager")
        with torch._dynamo.config.patch(recompile_limit=1), recompile_limits_hit() as hits:
            for dtype in (torch.float32, torch.float64, torch.int32, torch.int64):
                add_one(torch.ones(2, dtype=dtype))
        return hits

    named = hit_the_limit()
    assert len(named) == 1 and "recompile_limit" in named[0] and "<lambda>" in named[0]
    logger = logging.getLogger("torch._dynamo")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        unnamed = hit_the_limit()
    finally:
        logger.setLevel(level)
    assert unnamed == ["torch._dynamo hit its recompile limit (the warning naming the function was not logged)"]


def test_bench_diffusion_gemma_against_transformers_generate(capsys):
    """The DiffusionGemma bench (tiny shape): both sides take every denoising step of both canvases, and the table
    prints the first call beside the warm one."""
    pytest.importorskip("transformers", minversion="5.12")
    args = ["bench", "--shape", "diffusion-gemma-tiny", "--prompt-len", "5", "--new-tokens", "16",
            "--denoising-steps", "3", "--device", "cpu", "--dtype", "float32"]
    assert main(args + ["--json"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    ours, reference = report["results"]
    assert [ours["name"], reference["name"]] == ["hf_blockdiff", "transformers generate"]
    assert ours["forwards"] == reference["forwards"] == 2 * 3 and report["first_call"]["forwards"] == 6
    assert main(args + ["--batch-size", "2"]) == 0
    table = capsys.readouterr().out
    assert "hf_blockdiff (first call)" in table and "transformers generate" in table


@pytest.mark.parametrize("editing", [[], ["--editing-threshold", "0.5"]])
def test_bench_llada2_against_diffusers(capsys, editing):
    """LLaDA2 shapes run the llada2 (llada2_1 with --editing-threshold) preset against diffusers' LLaDA2Pipeline:
    random weights never reach τ = 0.7, so both take one token per step, 32 steps per block of 32."""
    code = main(["bench", "--shape", "llada2-tiny", "--prompt-len", "40", "--new-tokens", "56", "--device", "cpu",
                 "--dtype", "float32", "--json", *editing])
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    ours, reference = report["results"]
    assert code == 0 and reference["name"] == "reference (diffusers_llada2)"
    # blocks [32, 64) and [64, 96) hold 24 and 32 masks; ours adds the prefill forward; diffusers runs one more
    # forward on the first block, filled before its 32nd step (with editing, ours too: its refinement step)
    assert reference["forwards"] == 24 + 1 + 32 and ours["forwards"] == 1 + 24 + bool(editing) + 32


@pytest.mark.parametrize("extra, message", [
    (["--shape", "llada2-tiny", "--strategy", "sequential"], "drop --strategy"),
    (["--shape", "tiny", "--editing-threshold", "0.5"], "--editing-threshold needs a LLaDA2 model"),
    (["--shape", "tiny", "--batch-invariant", "--compile", "on"], "batch_invariant=True runs them uncompiled"),
    (["--shape", "llada2-tiny", "--top-k", "5"], "drop --strategy, --max-active-blocks, --temperature and --top-k"),
    (["--shape", "tiny", "--top-k", "5"], "--top-k 5 filters sampled proposals"),
    (["--shape", "diffusion-gemma-tiny", "--temperature", "1", "--top-k", "5", "--block-size", "8"],
     "which read no --block-size, --temperature, --top-k: drop them"),
])
def test_bench_refuses_settings_its_reference_lacks(capsys, extra, message):
    assert main(["bench", *extra, "--device", "cpu", "--dtype", "float32", "--new-tokens", "8"]) == 2
    assert message in capsys.readouterr().err


def test_serve_batch_invariant_reaches_the_runtime_options():
    from hf_blockdiff.cli import build_parser, config_from_args

    for flags, expected in (([], False), (["--batch-invariant"], True)):
        args = build_parser().parse_args(["serve", "--model", "demo", *flags])
        assert config_from_args(args).runtime.batch_invariant is expected


def test_bench_rollouts_share_pages(capsys):
    """--num-return-sequences: the shared rollouts hold fewer KV pages than the same rows as repeated prompts; with
    --shared-prefix every prompt starts with the same tokens and reads them from the prefix store."""
    code = main(["bench", "--shape", "tiny", "--batch-size", "2", "--prompt-len", "72", "--new-tokens", "8",
                 "--device", "cpu", "--dtype", "float32", "--num-return-sequences", "4", "--shared-prefix", "64",
                 "--temperature", "1.0", "--json"])
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    shared, repeated = report["results"]
    assert code == 0 and (shared["name"], repeated["name"]) == ("shared K/V", "repeated prompts")
    assert shared["tokens"] == repeated["tokens"] == 2 * 4 * 8
    # pages of 64: a canvas of 80 takes 2. Shared: the store's page of the common 64 tokens, and one page per sample
    # (the leader's holds tokens 64-72 of its prompt, the others' a copy of it)
    assert report["kv_ratio"] == pytest.approx((1 + 2 * 4) / (2 * 4 * 2), abs=1e-3)


def test_bench_samples_with_top_k():
    """--top-k reaches the config hf_blockdiff decodes with (with --temperature; alone it is refused, above)."""
    from hf_blockdiff.cli import build_parser
    from hf_blockdiff.tools.bench_models import build_model
    from hf_blockdiff.tools.decode_flags import decode_config

    args = build_parser().parse_args(["bench", "--temperature", "1", "--top-k", "5"])
    cfg = decode_config(args, build_model("tiny", None, "cpu", torch.float32))
    assert (cfg.temperature, cfg.top_k) == (1.0, 5)


def test_bench_tensor_parallel_needs_a_launch(capsys):
    assert main(["bench", "--shape", "tiny", "--device", "cpu", "--tensor-parallel"]) == 2
    assert "torchrun --nproc_per_node N -m hf_blockdiff.cli bench" in capsys.readouterr().err


NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")


@pytest.mark.parametrize("command", ["generate", "bench", "train-tiny"])
@pytest.mark.parametrize("device, message", [
    pytest.param("cuda", "--device 'cuda' is not available in this process (available: cpu)", marks=NO_CUDA),
    ("cuda:99", "--device 'cuda:99' is not available in this process (available: cpu"),
    ("gpu0", "--device 'gpu0' is no device name: pass one of cpu"),
])
def test_a_device_that_is_not_there_is_one_line(checkpoint, capsys, tmp_path, command, device, message):
    """It was a traceback from deep inside torch (exit 1)."""
    source = {"generate": ["--model", str(checkpoint), "--prompt", "hi"], "bench": [],
              "train-tiny": ["--out", str(tmp_path / "run")]}[command]
    assert main([command, *source, "--device", device]) == 2
    assert not (tmp_path / "run").exists()  # train-tiny refused before it made its output folder
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("hf-blockdiff: error: ") and message in err[0]


def test_load_pretrained_names_the_device(checkpoint):
    with pytest.raises(ValueError, match=r"device 'cuda:99' is not available in this process \(available: cpu"):
        load_pretrained(str(checkpoint), device="cuda:99")


def test_devices_of_a_two_gpu_host(monkeypatch):
    from hf_blockdiff.integrations import checkpoint

    monkeypatch.setattr(checkpoint, "available_devices", lambda: ["cpu", "cuda:0", "cuda:1"])
    for device in ("cpu", "cuda", "cuda:1"):
        checkpoint.check_device(device)
    for device in ("cuda:7", "mps"):
        with pytest.raises(ValueError, match=rf"'{device}' is not available .*\(available: cpu, cuda:0, cuda:1\)"):
            checkpoint.check_device(device)


def test_bench_random_weights_are_the_same_in_every_process_and_leave_the_callers_rng():
    """Seeded, so tokens of two bench processes (an A/B of two trees) can be compared."""
    from hf_blockdiff.tools.bench_models import build_model

    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    first, second = (build_model("tiny", None, "cpu", torch.float32) for _ in range(2))
    assert torch.equal(torch.rand(3), expected)
    assert all(torch.equal(a, b) for a, b in zip(first.state_dict().values(), second.state_dict().values()))
