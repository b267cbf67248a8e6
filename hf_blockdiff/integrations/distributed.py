"""Data parallelism, tensor parallelism and both at once (docs/architecture.md, "Around the loop").

Data parallel: prompts split over the processes of an `accelerate launch` (or `torchrun`), completions gathered back
in input order on every process.

Tensor parallel × data parallel: a launch of N·M processes forms M groups of N ranks (ranks g·N .. g·N+N-1 are group
g). transformers shards a model only over the whole default process group (both 5.17 and 5.23 check that the world
size is the product of the parallel sizes; 5.23 builds data-parallel replicas only through FSDP2), so
`init_tensor_parallel(N)` makes each group its own default process group, rendezvousing through the launcher's store,
and `from_pretrained(..., distributed_config=DistributedConfig(tp_plan="auto", tp_size=N))` then shards over the
group alone. Each group decodes a contiguous share of the prompts; the first rank of each group puts its completions
in the launcher's store and every process reads them all back, in input order. With N equal to the launch's size
there is one group, transformers initializes the process group itself, and every process decodes every prompt.

The shards live where the caller says (`shard_device`): on the CPU over gloo, or on an accelerator over NCCL, one
accelerator per process (`LOCAL_RANK`); `load_sharded` does all of it for a `from_pretrained`.
"""

from __future__ import annotations

import itertools
import os
import pickle
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from ..config import BlockDiffusionConfig
from ..weights.packed_shards import pack_shards
from ..weights.shard_layout import check_fits, check_shards, shard_layout
from ..weights.sharding import check_sharding, load_untied, meta_model, sharding_config
from ..weights.tensor_parallel import tensor_parallel_size
from .completions import Completions, complete


def process_state():
    """accelerate's `PartialState` of this launch. accelerate counts CPU processes only when told to run on the CPU;
    on a machine without an accelerator it is, so a `torchrun` of CPU processes is seen (gloo)."""
    from accelerate import PartialState

    return PartialState(cpu=not torch.accelerator.is_available())


def launch_size() -> int:
    """Processes of the launch (`WORLD_SIZE`, set by torchrun and accelerate launch; 1 without a launcher)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def is_main_process() -> bool:
    """Rank 0 of the launch (also when the default process group is a tensor-parallel group)."""
    return int(os.environ.get("RANK", "0")) == 0


@dataclass
class TensorParallelGroups:
    """Where this process sits among the launch's tensor-parallel groups, and the launcher's store they share."""

    store: object
    rank: int
    world_size: int
    tp_size: int
    calls: itertools.count = field(default_factory=itertools.count)

    @property
    def group(self) -> int:
        return self.rank // self.tp_size

    @property
    def groups(self) -> int:
        return self.world_size // self.tp_size

    def gather(self, mine):
        """Every group's `mine` (completions, a measurement, or an error) in group order, on every process. The last
        process to read them deletes the keys, so the store does not grow with the calls."""
        prefix = f"hf_blockdiff/groups/{next(self.calls)}"
        if self.rank % self.tp_size == 0:
            self.store.set(f"{prefix}/{self.group}", pickle.dumps(mine))
        parts = [pickle.loads(self.store.get(f"{prefix}/{group}")) for group in range(self.groups)]
        if self.store.add(f"{prefix}/read", 1) == self.world_size:
            for key in [f"{prefix}/{group}" for group in range(self.groups)] + [f"{prefix}/read"]:
                self.store.delete_key(key)
        return parts


_GROUPS: TensorParallelGroups | None = None  # set by init_tensor_parallel when the launch holds several groups


def check_tensor_parallel_size(size: int) -> None:
    """`size` ranks per tensor-parallel group must fit the launch: at least 1, dividing its process count."""
    world = launch_size()
    if not isinstance(size, int) or size < 1:
        raise ValueError(f"tensor_parallel_size={size!r}: pass a positive number of processes per model shard group")
    if size > 1 and world < 2:
        raise ValueError("tensor parallelism shards over several processes: launch with "
                         "`torchrun --nproc_per_node N ...` (N dividing the model's attention head counts)")
    if world % size:
        raise ValueError(f"tensor_parallel_size={size} does not divide the launch's {world} processes: launch "
                         f"N·M processes for M data-parallel groups of N (torchrun --nproc_per_node {size * 2} for "
                         f"two groups), or pass a tensor_parallel_size that divides {world}")


def shard_device(device: str | None = None) -> str:
    """The device type a tensor-parallel model's shards go to: `device`'s ("cpu", "cuda"; each process takes its own
    accelerator, `LOCAL_RANK`, whatever index `device` names), or for None the accelerator when this process sees
    one, else the CPU."""
    if device is not None:
        return torch.device(device).type
    accelerator = torch.accelerator.current_accelerator(check_available=True)
    return "cpu" if accelerator is None else accelerator.type


def check_devices(device_type: str) -> None:
    """Shards on an accelerator bind each process of this machine to an accelerator of its own (NCCL): a process past
    the last one would die binding, the others waiting for it; say so before anything is loaded."""
    if device_type == "cpu":
        return
    processes = int(os.environ.get("LOCAL_WORLD_SIZE", launch_size()))
    available = torch.accelerator.device_count()
    if processes > available:
        raise ValueError(f"tensor parallelism on {device_type} gives each process a GPU of its own (NCCL), but this "
                         f"launch runs {processes} processes on a machine with {available} GPU(s): launch at most "
                         f"{available} processes here (torchrun --nproc_per_node {available}), or shard on the CPU "
                         "(device cpu: gloo)")


def init_tensor_parallel(size: int, device: str | None = None) -> str:
    """Before `from_pretrained(..., distributed_config=DistributedConfig(tp_plan="auto", tp_size=size))` in a launch
    of groups of `size` ranks: check the launch and the accelerators, bind this process to its accelerator `LOCAL_RANK`
    (shards on an accelerator), and when the launch holds several groups make this process's group the default process
    group (see the module's doc). Call it on every process of the launch. Returns `shard_device(device)`."""
    global _GROUPS
    check_tensor_parallel_size(size)
    device_type = shard_device(device)
    check_devices(device_type)
    if device_type != "cpu":
        torch.accelerator.set_device_index(int(os.environ.get("LOCAL_RANK", "0")))
    if size == launch_size() or (_GROUPS is not None and _GROUPS.tp_size == size):
        return device_type
    if torch.distributed.is_initialized():
        raise ValueError(f"tensor_parallel_size={size}: torch.distributed is already initialized over "
                         f"{torch.distributed.get_world_size()} processes; call init_tensor_parallel (or "
                         "load_pretrained(..., tensor_parallel_size=...)) before anything initializes it")
    store, rank, world = next(torch.distributed.rendezvous("env://"))
    _GROUPS = TensorParallelGroups(store, rank, world, size)
    torch.distributed.init_process_group(
        torch.distributed.get_default_backend_for_device(device_type),
        store=torch.distributed.PrefixStore(f"hf_blockdiff/tp{_GROUPS.group}", store), rank=rank % size,
        world_size=size)
    return device_type


_ACCELERATOR_SHOWN = threading.Lock()


@contextmanager
def _transformers_sees(device_type: str):
    """transformers picks the device and backend of its tensor-parallel mesh from `torch._C._get_accelerator()`: the
    accelerator torch was built with, whether or not this process sees one, so on a CUDA build it would put CPU
    shards on cuda:LOCAL_RANK. For shards on the CPU it is shown the CPU while it loads."""
    if device_type != "cpu":
        yield
        return
    with _ACCELERATOR_SHOWN:  # one load at a time swaps it, so each puts back what it found
        built = torch._C._get_accelerator
        torch._C._get_accelerator = lambda check=None: torch.device("cpu")
        try:
            yield
        finally:
            torch._C._get_accelerator = built


def check_layout(model, size: int, device_type: str, expert_parallel: bool = False, free: int | None = None) -> None:
    """Before `model` (a copy on the meta device, `meta_model`) is built or loaded over `size` processes: a ValueError
    when tp_plan cannot split its weights evenly (the experts' split is `weights.sharding`'s to check under
    `expert_parallel`), or when the weights one process holds do not fit its GPU (`free` bytes; None: what the bound
    GPU has free; never checked on the CPU)."""
    layout = shard_layout(model, size)
    if not expert_parallel:
        check_shards(layout)
    if free is not None:
        check_fits(layout, free, device_type)
    elif device_type == "cuda":
        check_fits(layout, torch.cuda.mem_get_info()[0], f"cuda:{torch.cuda.current_device()}")


def _weights_dtype(config, dtype):
    """`from_pretrained`'s `dtype` as a torch dtype: "auto" is the checkpoint's own."""
    if isinstance(dtype, str):
        return getattr(torch, str(getattr(config, "dtype", None) or "float32").removeprefix("torch."))
    return dtype


def load_sharded(model_class, path: str | None, size: int, device: str | None = None, expert_parallel: bool = False,
                 **kwargs):
    """`model_class.from_pretrained(path, **kwargs)` sharded with transformers' tp_plan="auto" over groups of `size`
    processes (`init_tensor_parallel`), on `device`'s type (`shard_device`): cuda:LOCAL_RANK over NCCL, or the CPU over
    gloo; `expert_parallel`: a MoE model's experts split whole over the group. Each process reads only its shards of
    the checkpoint. With a config (`config=` or the checkpoint directory's), the sizes are checked, and the model's
    plans spelled out and its layout checked on one copy on the meta device, before anything loads
    (`weights.sharding`, `check_layout`). Each layer's q/k/v and gate/up shards end side by side in one buffer
    (`weights.packed_shards`). Call it on every process of the launch."""
    check_devices(shard_device(device))  # a process without a GPU of its own fails first: say so before all else
    config = kwargs.get("config")
    if config is None and (expert_parallel or (path is not None and os.path.isdir(path))):
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(path)
    meta = None
    if config is not None:
        check_sharding(config, size, expert_parallel)
        meta = meta_model(model_class, config, _weights_dtype(config, kwargs.get("dtype")))
    distributed_config = sharding_config(meta, size, expert_parallel)
    device_type = init_tensor_parallel(size, device)
    if meta is not None:
        check_layout(meta, size, device_type, expert_parallel)

    def load(config):
        given = kwargs if config is None else {**kwargs, "config": config}
        return model_class.from_pretrained(path, distributed_config=distributed_config, **given)

    with _transformers_sees(device_type):
        model = load_untied(load, config)
    pack_shards(model)
    return model


def build_sharded(config, size: int, device: str | None = None, dtype=None, seed: int = 0,
                  expert_parallel: bool = False, model_class=None):
    """Random weights of `config` sharded over groups of `size` processes, never whole on any: transformers builds
    the model on the meta device, splits it by tp_plan and gives each process only its shards, which it initializes
    where they live (cuda:LOCAL_RANK, or the CPU). The same `seed` on every process makes the weights kept whole
    (norms, router, embeddings, attention when the plan keeps it whole) agree; the shards may differ. `model_class`:
    the class to build (default: the causal LM of `config`'s type). Call it on every process of the launch."""
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING
    from transformers.utils import logging

    torch.manual_seed(seed)
    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()  # its load report would list every weight as missing from the checkpoint
    try:
        return load_sharded(model_class or MODEL_FOR_CAUSAL_LM_MAPPING[type(config)], None, size, device,
                            expert_parallel, config=config, state_dict={}, dtype=dtype)
    finally:
        logging.set_verbosity(verbosity)


def _share(items: list, index: int, parts: int) -> list:
    """The `index`-th of `parts` contiguous shares of `items`, the first ones one longer (as accelerate splits)."""
    base, extra = divmod(len(items), parts)
    start = index * base + min(index, extra)
    return items[start : start + base + (index < extra)]


def generate_distributed(model, prompts: list, config: BlockDiffusionConfig | None = None, tokenizer=None, *,
                         batch_size: int = 16, chat: bool = False, progress: bool = False) -> Completions:
    """Completions of `prompts` (strings, token-id lists or chat messages; see `completions.encode`), this process
    (or its tensor-parallel group, for a model loaded with `tp_size`) decoding a contiguous share of them. Every
    process gets all of them back, in input order; `progress` shows a bar on the main process. Call it on every
    process, with the same prompts."""
    tp_size = tensor_parallel_size(model)
    if tp_size > 1:
        return _generate_tensor_parallel(model, list(prompts), config, tokenizer, tp_size, batch_size=batch_size,
                                         chat=chat, progress=progress and is_main_process())
    from accelerate.utils import gather_object

    state = process_state()
    progress = progress and state.is_main_process
    if state.num_processes == 1:
        return complete(model, prompts, config, tokenizer, batch_size=batch_size, chat=chat, progress=progress)
    with state.split_between_processes(list(prompts)) as share:
        mine = complete(model, share, config, tokenizer, batch_size=batch_size, chat=chat, progress=progress)
    return Completions.joined(gather_object([mine]))


def group_share(items: list, tp_size: int) -> list:
    """This process's tensor-parallel group's contiguous share of `items` (all of them when one group holds the
    launch)."""
    if tp_size == launch_size():
        return items
    if _GROUPS is None or _GROUPS.tp_size != tp_size:
        raise ValueError(f"the model is sharded over {tp_size} of the launch's {launch_size()} processes: call "
                         f"init_tensor_parallel({tp_size}) before from_pretrained, or load with "
                         f"load_pretrained(..., tensor_parallel_size={tp_size})")
    return _share(items, _GROUPS.group, _GROUPS.groups)


def gather_groups(mine):
    """Every tensor-parallel group's `mine` (its first rank's) in group order, on every process; an exception from any
    group is raised on every process instead of leaving the others waiting. One group: [mine]."""
    parts = [mine] if _GROUPS is None else _GROUPS.gather(mine)
    failure = next((part for part in parts if isinstance(part, Exception)), None)
    if failure is not None:
        raise failure
    return parts


def _generate_tensor_parallel(model, prompts: list, config, tokenizer, tp_size: int, **kwargs) -> Completions:
    """A tensor-parallel model: its group decodes its share (all prompts when one group holds the launch)."""
    if tp_size == launch_size():
        return complete(model, prompts, config, tokenizer, **kwargs)
    try:
        mine = complete(model, group_share(prompts, tp_size), config, tokenizer, **kwargs)
    except Exception as error:  # published like completions: the other groups raise it too instead of waiting
        mine = error
    return Completions.joined(gather_groups(mine))
