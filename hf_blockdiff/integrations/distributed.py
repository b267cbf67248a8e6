"""Data parallelism: prompts split over the processes of an `accelerate launch` (or `torchrun`), completions
gathered back in input order on every process (docs/design.md, "Around the loop").

A tensor-parallel model (see `hf_blockdiff.tensor_parallel`) already spreads one decode over the processes: then
every process decodes every prompt and nothing is split.
"""

from __future__ import annotations

import torch

from ..config import BlockDiffusionConfig
from ..tensor_parallel import tensor_parallel_size
from .completions import Completions, complete


def process_state():
    """accelerate's `PartialState` of this launch. accelerate counts CPU processes only when told to run on the CPU;
    on a machine without an accelerator it is, so a `torchrun` of CPU processes is seen (gloo)."""
    from accelerate import PartialState

    return PartialState(cpu=not torch.accelerator.is_available())


def generate_distributed(model, prompts: list, config: BlockDiffusionConfig | None = None, tokenizer=None, *,
                         batch_size: int = 16, chat: bool = False, progress: bool = False) -> Completions:
    """Completions of `prompts` (strings, token-id lists or chat messages; see `completions.encode`), this process
    decoding a contiguous share of them. Every process gets all of them back, in input order; `progress` shows a bar
    on the main process. Call it on every process, with the same prompts."""
    from accelerate.utils import gather_object

    state = process_state()
    progress = progress and state.is_main_process
    if state.num_processes == 1 or tensor_parallel_size(model) > 1:
        return complete(model, prompts, config, tokenizer, batch_size=batch_size, chat=chat, progress=progress)
    with state.split_between_processes(list(prompts)) as share:
        mine = complete(model, share, config, tokenizer, batch_size=batch_size, chat=chat, progress=progress)
    return Completions.joined(gather_object([mine]))
