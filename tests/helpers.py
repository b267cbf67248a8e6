"""Tiny models and prompts shared by the tests."""

import os
import socket
import threading

import torch
from transformers import (
    LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

import hf_blockdiff  # noqa: F401  (patches the stock classes)

VOCAB, MASK = 96, 95
FAMILIES = {
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "llama": (LlamaConfig, LlamaForCausalLM),
    "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM),  # pass num_experts, num_experts_per_tok, moe_intermediate_size
}


def tiny_model(family: str = "qwen3", seed: int = 0, **config):
    """A tiny fp32 random model whose confidences spread over (0, 1), so thresholds fire and ties are absent."""
    config_class, model_class = FAMILIES[family]
    torch.manual_seed(seed)
    defaults = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, initializer_range=0.5, max_position_embeddings=512,
        attn_implementation="sdpa", tie_word_embeddings=False,
    )
    defaults.update(config)
    return model_class(config_class(**defaults)).eval()


def forget_compiled_regions():
    """What a new process holds of the compiled layers' regions (`fusion/regions.py`, module-level and shared by every
    model) and of the artifacts compiled ahead of time (`fusion/ahead_of_time.py`): no variant loaded, preloaded or
    traced, none looked up, no failure; a compile cache's directory stays."""
    from hf_blockdiff.fusion import ahead_of_time, regions

    for region in regions.AHEAD_OF_TIME:
        region.variants.clear()
        region.sent.clear()
        region.failed.clear()
    ahead_of_time._USED.clear()
    ahead_of_time._PRELOADED.clear()


def random_prompts(lengths, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, MASK - 4, (n,), generator=generator) for n in lengths]


def left_pad(prompts, pad=0):
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = prompt
        mask[row, width - len(prompt):] = 1
    return ids, mask


CHARS = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ \n!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~"[:MASK]
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def char_tokenizer():
    """A character-level fast tokenizer over the tiny models' vocabulary: id i < MASK is CHARS[i], MASK is <mask>."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(CHARS)}
    vocab["<mask>"] = MASK
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<mask>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, mask_token="<mask>", unk_token="<mask>", chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )


def save_checkpoint(path, **config):
    """A tiny Qwen3 checkpoint with the char tokenizer, decodable without flags (mask id, block size in its config)."""
    model = tiny_model("qwen3", **config)
    model.config.mask_token_id, model.config.block_size = MASK, 4
    model.save_pretrained(path)
    char_tokenizer().save_pretrained(path)
    return path


class Collector:
    """A row's updates, and an event set by its final one."""

    def __init__(self):
        self.updates, self.done = [], threading.Event()

    def __call__(self, update):
        self.updates.append(update)
        if update.finish_reason is not None:
            self.done.set()

    @property
    def tokens(self):
        return [t for u in self.updates for t in u.tokens]

    @property
    def logprobs(self):
        return [x for u in self.updates for x in u.logprobs]

    def final(self, timeout=60):
        assert self.done.wait(timeout), "the row got no final update"
        assert [u.finish_reason is not None for u in self.updates].count(True) == 1
        return self.updates[-1]


def free_port() -> int:
    """A TCP port of 127.0.0.1 free a moment ago (for a process launched next to listen on)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def on_python_path(environment: dict, directory) -> dict:
    """`environment` with `directory` first on its PYTHONPATH (a subprocess importing from it)."""
    return {**environment, "PYTHONPATH": os.pathsep.join([str(directory), environment.get("PYTHONPATH", "")])}


def run_forked(target, args_per_process: list, bound_s: float = 120) -> None:
    """`target(*args)` for each args in forked processes running at once (CPU tensors made shared before the fork keep
    their addresses in every process: ranks of the symmetric-memory kernels under Triton's interpreter); each is
    killed past `bound_s`, and every one must exit cleanly."""
    import multiprocessing

    context = multiprocessing.get_context("fork")
    processes = [context.Process(target=target, args=args) for args in args_per_process]
    for process in processes:
        process.start()
    for process in processes:
        process.join(bound_s)
        if process.is_alive():
            process.kill()
            process.join()
    assert [p.exitcode for p in processes] == [0] * len(processes), "a process failed or ran past the bound"


def one_shot_group(world: int, slot_bytes: int, device="cpu") -> tuple[list, list, torch.Tensor, torch.Tensor]:
    """Every rank's slots and signal pad of the one-shot sum (kernels/one_shot_sum.py) as plain memory of `device`
    (shared across a fork on the CPU), and the address tables the kernel takes: (memory, pads, slots, flags). The
    caller holds `memory` and `pads` while the kernel runs: the tables are bare addresses."""
    from hf_blockdiff.kernels.one_shot_sum import buffer_bytes, pad_bytes

    memory = [torch.zeros(buffer_bytes(world, slot_bytes), dtype=torch.uint8, device=device) for _ in range(world)]
    pads = [torch.zeros(pad_bytes(world) // 8, dtype=torch.int64, device=device) for _ in range(world)]
    if torch.device(device).type == "cpu":
        for tensor in memory + pads:
            tensor.share_memory_()
    slots = torch.tensor([m.data_ptr() for m in memory], device=device)
    flags = torch.tensor([p.data_ptr() for p in pads], device=device)
    return memory, pads, slots, flags
