"""Train the tiny SDAR-style block-diffusion demo model on the synthetic task of `hf_blockdiff.tools.tasks`.

Objective (BD3-LM / SDAR): a row is `prompt + answer + <eos> + <pad>...` of `seq_len` tokens, cut into blocks of
`block_size` at absolute positions. Each block draws a mask ratio t ~ U(0, 1] and masks each of its maskable
positions with probability t. Maskable are all positions after the prompt: the answer, `<eos>` and the padding,
which is trained to be `<pad>` so the model learns to stop. The prompt is never masked, also where its tail shares
the first answer block. The model reads `[x_t | x_0]` (2L tokens, position ids 0..L-1 twice) under a 4D additive mask:
noisy block k sees clean blocks < k and itself; clean block k sees clean blocks <= k. The loss is the mean
cross-entropy over masked positions of the noisy half, unweighted (no 1/t factor: lower variance, and we want
decoding accuracy rather than a likelihood bound). No logit shift: position i predicts token i.

That is exactly the decoding contract of an SDAR checkpoint (`model_type: sdar`): a prefix encoded under the
block-causal (staircase) mask, the current block attending to the prefix and to itself. Held-out accuracy is measured
with `generate_multi_block` itself.

The bundled checkpoint (hf_blockdiff/assets/demo_model, 1.63 M parameters, 6.3 MB) came from
`hf-blockdiff train-tiny --out hf_blockdiff/assets/demo_model --seed 0` (3000 steps, 2 torch threads) on a 2-core CPU
in 549 s of training (9 min 15 s wall with evaluation), 2026-11-22: final loss 0.0078; on 200 held-out problems
sequential decoding 99.5 %, confidence-threshold decoding (τ = 0.9) 100 %. The same seed and thread count give the
same weights.

`--preset hard` trains an 11.4 M-parameter model on the hard task family (for a GPU: bf16 autocast on CUDA, saved in
bf16, its held-out accuracy measured on the saved weights); `--max-minutes` stops a run and leaves its state (weights,
optimizer, schedule, noise generator, position in the data) in `--out`, from which the same command resumes bit for
bit. The bundled hard model (hf_blockdiff/assets/hard_model) came from `hf-blockdiff train-tiny --preset hard --device
cuda --seed 0 --steps 9700 --max-minutes 7.6` run twice on an H100, 2026-11-24 (746 s of training; its
training.json records the run): 96.2 % of 500 held-out problems sequentially, 96.0 % at 2.76 tokens per forward with
τ = 0.9. Seed 1, trained beside it, landed at 84.2 % (docs/benchmarks.md, "The strategy table").
"""

from __future__ import annotations

import itertools
import json
import math
import os
import random
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import PreTrainedTokenizerFast

from ..config import BlockDiffusionConfig
from ..model_patches.sdar import SDARConfig, SDARForCausalLM
from .tasks import build_tokenizer, family, make_problems, problem_stream, solve

EVAL_SEED = 1234
DEFAULT_STEPS = 3000
STATE_FILE = "trainer_state.pt"  # a run stopped by its time limit, until it finishes
RECORD_FILE = "training.json"  # how a checkpoint was trained: task family, seed, config, losses, held-out accuracy


@dataclass(frozen=True)
class TinyModelConfig:
    hidden_size: int = 192
    num_layers: int = 4
    num_heads: int = 8
    num_kv_heads: int = 4
    head_dim: int = 24
    intermediate_size: int = 512
    rope_theta: float = 100.0  # fast-turning RoPE: the task is all about exact positions in ~20 tokens
    block_size: int = 4
    seq_len: int = 20  # training rows: longest prompt (12) + answer (6) + <eos>, rounded up to whole blocks
    max_positions: int = 64  # config.max_position_embeddings: room for a decoder's max_new_tokens (RoPE has no table)
    vocab_size: int = 48  # the tokenizer's 43 tokens, rounded up


@dataclass(frozen=True)
class TrainConfig:
    model: TinyModelConfig = field(default_factory=TinyModelConfig)
    task: str = "demo"  # family of hf_blockdiff.tools.tasks
    batch_size: int = 128
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 50
    weight_decay: float = 0.1  # helps addition generalize to held-out sums rather than memorize the training ones
    task_weights: tuple[float, ...] | None = (2, 1.5, 1)  # add, sort, rev: by how long each takes to learn
    pool_batches: int = 8
    eval_size: int = 200
    eval_threshold: float = 0.9
    weights_dtype: str = "float32"  # of the saved checkpoint; its held-out accuracy is measured on the saved weights


PRESETS = {
    "demo": TrainConfig(),  # the bundled CPU model (1.63 M parameters)
    # the hard family (answers up to 36 tokens): 11.4 M parameters (22.8 MB in bf16), for a GPU
    "hard": TrainConfig(
        model=TinyModelConfig(hidden_size=384, num_layers=7, num_heads=8, num_kv_heads=4, head_dim=48,
                              intermediate_size=1024, rope_theta=1000.0, seq_len=84, max_positions=128, vocab_size=56),
        task="hard", batch_size=256, lr=1e-3, warmup_steps=200, task_weights=(2, 2, 1, 1, 2, 1, 1), eval_size=500,
        weights_dtype="bfloat16"),
}


@dataclass
class TrainMetrics:
    steps: int
    train_seconds: float
    final_loss: float  # mean of the last 20 steps
    sequential_accuracy: float
    threshold_accuracy: float
    threshold_tokens_per_forward: float
    num_parameters: int
    losses: list[float]


def build_model(cfg: TinyModelConfig, tokenizer: PreTrainedTokenizerFast) -> SDARForCausalLM:
    """An SDAR model (Qwen3 architecture, `model_type: sdar`: block-causal, absolute blocks, no logit shift)."""
    config = SDARConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        max_position_embeddings=cfg.max_positions,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        mask_token_id=tokenizer.mask_token_id,
        block_size=cfg.block_size,
        attn_implementation="sdpa",
    )
    return SDARForCausalLM(config)


def save_checkpoint(model: SDARForCausalLM, tokenizer: PreTrainedTokenizerFast, out_dir: str) -> None:
    """Weights, tokenizer and a config.json without the legacy `torch_dtype` key. The SDAR config writes it beside
    `dtype` for the released remote code, which this checkpoint never meets; transformers warns when it loads it."""
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    path = Path(out_dir) / "config.json"
    config = json.loads(path.read_text())
    del config["torch_dtype"]
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def block_causal_mask(length: int, block_size: int) -> torch.Tensor:
    """[L, L] bool, True where query i may attend to key j: j's block <= i's block."""
    blocks = torch.arange(length) // block_size
    return blocks[None, :] <= blocks[:, None]


def training_layout(length: int, block_size: int, noisy_start: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Position ids and [Q, Q] bool attention mask of the training input `[x_t[noisy_start:] | x_0[:-block_size]]`.

    Noisy block k sees itself and clean blocks < k; the clean part is block-causal. Noisy blocks before `noisy_start`
    hold no masked position and no noisy block sees the last clean block, so both are left out (~30 % fewer tokens)."""
    noisy, clean = torch.arange(noisy_start, length), torch.arange(length - block_size)
    noisy_blocks, clean_blocks = noisy // block_size, clean // block_size
    noisy_rows = torch.cat([noisy_blocks[:, None] == noisy_blocks, clean_blocks < noisy_blocks[:, None]], dim=1)
    clean_rows = torch.cat([torch.zeros(len(clean), len(noisy), dtype=torch.bool), clean_blocks <= clean_blocks[:, None]], dim=1)
    return torch.cat([noisy, clean]), torch.cat([noisy_rows, clean_rows])


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A bool [Q, K] mask as the [1, 1, Q, K] float mask transformers passes through to attention unchanged."""
    return torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)[None, None]


def encode(problems: list[tuple[str, str]], tokenizer: PreTrainedTokenizerFast, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows `prompt + answer + <eos> + <pad>...` of `seq_len` ids, and each row's answer start (= prompt length)."""
    ids = torch.full((len(problems), seq_len), tokenizer.pad_token_id, dtype=torch.long)
    prompts = tokenizer([p for p, _ in problems], add_special_tokens=False)["input_ids"]
    answers = tokenizer([a for _, a in problems], add_special_tokens=False)["input_ids"]
    for row, (p, a) in enumerate(zip(prompts, answers)):
        tokens = p + a + [tokenizer.eos_token_id]
        if len(tokens) > seq_len:
            raise ValueError(f"problem of {len(tokens)} tokens does not fit seq_len={seq_len}")
        ids[row, : len(tokens)] = torch.tensor(tokens)
    return ids, torch.tensor([len(p) for p in prompts])


def add_noise(x0: torch.Tensor, answer_start: torch.Tensor, block_size: int, mask_id: int, generator: torch.Generator):
    """Mask the positions after the prompt, each with its block's ratio t ~ U(0, 1]; returns (x_t, masked)."""
    rows, length = x0.shape
    t = 1.0 - torch.rand(rows, length // block_size, generator=generator)  # drawn on the CPU: same noise anywhere
    draws = torch.rand(rows, length, generator=generator) < t.repeat_interleave(block_size, dim=1)
    maskable = torch.arange(length, device=x0.device)[None, :] >= answer_start[:, None]
    masked = maskable & draws.to(x0.device)
    return torch.where(masked, mask_id, x0), masked


def diffusion_loss(model, x0: torch.Tensor, answer_start: torch.Tensor, mask_id: int, generator: torch.Generator) -> torch.Tensor:
    length, block_size = x0.shape[1], model.config.block_size
    noisy_start = int(answer_start.min()) // block_size * block_size
    positions, allowed = training_layout(length, block_size, noisy_start)
    xt, masked = add_noise(x0, answer_start, block_size, mask_id, generator)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=x0.is_cuda):  # fp32 on the CPU: exact per thread count
        hidden = model.model(
            input_ids=torch.cat([xt[:, noisy_start:], x0[:, : length - block_size]], dim=1),
            attention_mask=additive_mask(allowed).to(x0.device),
            position_ids=positions[None].to(x0.device),
        ).last_hidden_state
        masked = masked[:, noisy_start:]
        logits = model.lm_head(hidden[:, : length - noisy_start][masked])
    return F.cross_entropy(logits.float(), x0[:, noisy_start:][masked])


def training_batches(cfg: TrainConfig, seed: int) -> Iterator[list[tuple[str, str]]]:
    """Endless deterministic batches of (prompt, answer). Problems are drawn in pools of `pool_batches` batches and
    grouped by length, so that cutting each batch after the block holding its longest row's `<eos>` (`encode_batch`)
    saves about 40 % of the tokens of padding every row to `seq_len`."""
    problems = problem_stream(seed, "train", cfg.task_weights, cfg.task)
    order = random.Random(seed)
    block = cfg.model.block_size
    while True:
        pool = [next(problems) for _ in range(cfg.batch_size * cfg.pool_batches)]
        pool.sort(key=lambda pa: (len(pa[0]) // block, len(pa[0]) + len(pa[1])))
        batches = [pool[i : i + cfg.batch_size] for i in range(0, len(pool), cfg.batch_size)]
        order.shuffle(batches)
        yield from batches


def encode_batch(batch: list[tuple[str, str]], tokenizer: PreTrainedTokenizerFast, block: int):
    longest = max(len(p) + len(a) + 1 for p, a in batch)
    return encode(batch, tokenizer, -(-longest // block) * block)


def _lr_factor(step: int, cfg: TrainConfig, steps: int) -> float:
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, steps - cfg.warmup_steps)
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def fit(cfg: TrainConfig, seed: int, steps: int, device: str = "cpu", log=print, state_path: Path | None = None,
        max_seconds: float | None = None):
    """Train a fresh model, or go on with the run saved at `state_path`; returns the `Run` (model in eval mode, one
    loss per step, seconds over all its parts). With `max_seconds`, training stops before the first step that would
    start later (each part takes one step at least) and saves the run (weights, optimizer, schedule, noise
    generator, position in the data) to `state_path`; the same call then resumes it bit for bit (fewer losses than
    `steps` tell that it stopped). Same seed, same threads: same weights."""
    start = time.perf_counter()
    torch.manual_seed(seed)
    torch.set_flush_denormal(True)  # denormals slow CPU steps down several-fold at times; flushing also fixes results
    tokenizer = build_tokenizer(cfg.task)
    model = build_model(cfg.model, tokenizer).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.98), weight_decay=cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: _lr_factor(step, cfg, steps))
    generator = torch.Generator().manual_seed(seed)
    run = Run(model, optimizer, scheduler, generator, {"config": asdict(cfg), "seed": seed, "steps": steps}, [], 0.0)
    if state_path is not None and state_path.exists():
        run.restore(state_path)
        if log:
            log(f"resuming at step {len(run.losses)} of {steps} from {state_path}")
    resumed_at = len(run.losses)
    batches = itertools.islice(training_batches(cfg, seed), resumed_at, None)
    model.train()
    for step in range(resumed_at, steps):
        if max_seconds is not None and step > resumed_at and time.perf_counter() - start > max_seconds:
            break
        x0, answer_start = encode_batch(next(batches), tokenizer, cfg.model.block_size)
        loss = diffusion_loss(model, x0.to(device), answer_start.to(device), tokenizer.mask_token_id, generator)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        run.losses.append(loss.item())
        if log and (step % 250 == 0 or step == steps - 1):
            log(f"step {step:5d}  loss {loss.item():.4f}  lr {scheduler.get_last_lr()[0]:.2e}  {time.perf_counter() - start:.0f}s")
    run.seconds += time.perf_counter() - start
    if len(run.losses) < steps:
        run.save(state_path)
        if log:
            log(f"stopped at step {len(run.losses)} of {steps} after {max_seconds:.0f}s: run again to resume")
    model.eval()
    return run


@dataclass
class Run:
    """A training run's state, saved between runs of limited time."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    generator: torch.Generator
    arguments: dict  # what must match for a resume: config, seed, steps
    losses: list[float]
    seconds: float  # spent training, over every part of the run

    def save(self, path: Path) -> None:
        torch.save({"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                    "scheduler": self.scheduler.state_dict(), "generator": self.generator.get_state(),
                    "arguments": self.arguments, "losses": self.losses, "seconds": self.seconds}, path)

    def restore(self, path: Path) -> None:
        state = torch.load(path, map_location=next(self.model.parameters()).device, weights_only=False)
        if state["arguments"] != self.arguments:
            raise ValueError(f"{path} holds a run with other arguments ({state['arguments']}): pass the same "
                             "seed, steps and preset to resume it, or another output directory")
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.generator.set_state(state["generator"].cpu())
        self.losses, self.seconds = state["losses"], state["seconds"]


def answer_room(task: str, block_size: int) -> int:
    """New tokens that hold any answer of family `task` and its `<eos>`, in whole blocks."""
    return -(-(family(task).max_answer_chars + 1) // block_size) * block_size


def evaluate(model, tokenizer, problems: list[tuple[str, str]], threshold: float | None = None,
             task: str = "demo") -> tuple[float, float]:
    """(exact-match accuracy, tokens per forward) of greedy decoding: one token per step left to right
    (`threshold=None`), or every position with confidence > threshold (at least one)."""
    room = answer_room(task, model.config.block_size)
    if threshold is None:
        cfg = BlockDiffusionConfig(max_new_tokens=room, strategy="sequential")
    else:
        cfg = BlockDiffusionConfig(max_new_tokens=room, strategy="low_confidence_dynamic", threshold=threshold,
                                   steps_per_block=model.config.block_size)
    result = solve(model, tokenizer, problems, cfg)
    return result.accuracy, result.tokens_per_forward


def train(out_dir: str, seed: int = 0, steps: int = DEFAULT_STEPS, device: str = "cpu",
          config: TrainConfig | None = None, log=print, max_seconds: float | None = None) -> TrainMetrics | None:
    """Train, evaluate on the held-out set and write the checkpoint (safetensors, config, tokenizer) to `out_dir`.
    With `max_seconds` a run that does not finish in time leaves its state in `out_dir` and returns None; the same
    call resumes it (the state is removed once the checkpoint is written)."""
    cfg = config or TrainConfig()
    os.makedirs(out_dir, exist_ok=True)
    state_path = Path(out_dir) / STATE_FILE
    run = fit(cfg, seed, steps, device, log, state_path, max_seconds)
    if len(run.losses) < steps:
        return None
    tokenizer, losses = build_tokenizer(cfg.task), run.losses
    saved_dtype = getattr(torch, cfg.weights_dtype)
    model = run.model.to(saved_dtype).float()  # the weights as saved, decoded in fp32 as a CPU user loads them
    held_out = make_problems(cfg.eval_size, EVAL_SEED, "held_out", task=cfg.task)
    sequential_accuracy, _ = evaluate(model, tokenizer, held_out, task=cfg.task)
    threshold_accuracy, tokens_per_forward = evaluate(model, tokenizer, held_out, cfg.eval_threshold, cfg.task)
    save_checkpoint(model.to(saved_dtype), tokenizer, out_dir)
    state_path.unlink(missing_ok=True)
    metrics = TrainMetrics(
        steps=steps,
        train_seconds=round(run.seconds, 1),
        final_loss=sum(losses[-20:]) / len(losses[-20:]),
        sequential_accuracy=sequential_accuracy,
        threshold_accuracy=threshold_accuracy,
        threshold_tokens_per_forward=tokens_per_forward,
        num_parameters=sum(p.numel() for p in run.model.parameters()),
        losses=losses,
    )
    record = {"task": cfg.task, "seed": seed, "device": str(device), "config": asdict(cfg),
              **{k: v for k, v in asdict(metrics).items() if k != "losses"}, "loss_every_500_steps": losses[::500]}
    (Path(out_dir) / RECORD_FILE).write_text(json.dumps(record, indent=1) + "\n")
    if log:
        log(f"trained {steps} steps in {run.seconds:.0f}s, final loss {metrics.final_loss:.4f}; held-out accuracy "
            f"sequential {sequential_accuracy:.3f}, threshold {threshold_accuracy:.3f} at {tokens_per_forward:.2f} tokens/forward")
    return metrics
