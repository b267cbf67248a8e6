"""How transformers shards a model over a tensor-parallel group (docs/architecture.md, "Around the loop"): the
model's own plans spelled out, and expert parallelism: a MoE model's experts split whole over the group's ranks,
attention and the dense MLPs tensor parallel as without it.

transformers shards experts by expert with the model's `base_model_ep_plan` (Qwen3-MoE's, so SDAR-MoE's; GLM-4-MoE's,
which LLaDA2's config takes; DiffusionGemma's own), but the two versions we run on do it differently:
- 5.24 (`DistributedConfig` has `ep_size`): `DistributedConfig(tp_plan="auto", tp_size=N, ep_size=N)`. The EP rules
  replace the TP rules of the experts modules: `grouped_gemm` gives each rank `num_experts / N` whole experts, and
  `ep_dispatch_experts` runs them (`AllReduceEP` at inference: the group shares one batch) on the whole batch with the
  routes to other ranks' experts masked; an all-reduce sums the ranks' outputs.
- 5.17: `enable_expert_parallel=True` swaps the whole TP plan for the EP plan, leaving attention replicated. Instead
  the `tp_plan` passed is the model's TP rules outside its experts plus its EP rules (`ep_router` masks the routes to
  other ranks' experts and renumbers the rest locally, `grouped_gemm` splits the experts, `moe_tp_experts` sums the
  ranks' outputs): on the one mesh, the same computation.
Either way the experts modules run their own forward (transformers' `grouped_mm` / `batched_mm` skip the masked
routes); our fused experts op leaves sharded experts alone (`fusion/experts.py`).
"""

from __future__ import annotations

import copy
import re

import torch

from .shard_layout import generic_name
from .tensor_parallel import check_head_counts

EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts")


def expert_count(config) -> int:
    """Routed experts per MoE layer of the model's (text) config; 0 for a dense model."""
    text = config.get_text_config()
    return next((n for n in (getattr(text, name, None) for name in EXPERT_COUNTS) if isinstance(n, int) and n > 0), 0)


def check_sharding(config, size: int, expert_parallel: bool) -> None:
    """Before loading: a ValueError naming the fix unless groups of `size` processes split what the plan shards:
    attention heads, and the experts (whole experts with `expert_parallel`, else each expert's width)."""
    experts = expert_count(config)
    if expert_parallel and size < 2:
        raise ValueError(f"expert_parallel=True splits the experts over a tensor-parallel group, but "
                         f"tensor_parallel_size={size}: pass tensor_parallel_size N > 1 (--tensor-parallel-size N) "
                         "under torchrun --nproc_per_node N")
    if expert_parallel and not experts:
        raise ValueError(f"expert_parallel=True: the {config.model_type} model has no experts (no num_experts in "
                         "its config): drop expert_parallel (--expert-parallel) and shard it with "
                         "tensor_parallel_size alone")
    if expert_parallel and experts % size:
        divisors = [n for n in range(2, experts + 1) if experts % n == 0][:4]
        raise ValueError(f"expert_parallel=True over {size} processes, but num_experts={experts} is not divisible "
                         f"by {size}: each process holds num_experts / N whole experts. Pass a tensor_parallel_size "
                         f"dividing {experts} (e.g. {', '.join(map(str, divisors))}), or drop expert_parallel to "
                         "split every expert's width instead")
    width = getattr(config.get_text_config(), "moe_intermediate_size", None)
    if size > 1 and experts and not expert_parallel and isinstance(width, int) and width % size:
        raise ValueError(f"tensor_parallel_size={size} splits every expert's width, but moe_intermediate_size="
                         f"{width} is not divisible by {size}: pass a tensor_parallel_size dividing it, or "
                         "expert_parallel=True (--expert-parallel) to split whole experts")
    if size > 1:
        check_head_counts(config, size)


def sharding_config(model, size: int, expert_parallel: bool):
    """transformers' `DistributedConfig` sharding `model` (a copy on the meta device, `meta_model`, whose sizes
    `check_sharding` passed) over `size` processes: its tp_plan, with `expert_parallel` its experts by expert (see the
    module's doc for the two versions). The plans are the model's own, spelled out (`model_plans`); without a model
    (no config at hand), tp_plan="auto"."""
    from transformers import DistributedConfig

    if model is None:
        return DistributedConfig(tp_plan="auto", tp_size=size)
    tensor, experts = model_plans(model)
    if not expert_parallel:
        return DistributedConfig(tp_plan=tensor, tp_size=size)
    if not experts:
        raise ValueError(f"expert_parallel=True: {type(model).__name__} declares no expert-parallel plan "
                         "(base_model_ep_plan): drop expert_parallel and shard it with tensor_parallel_size alone")
    if "ep_size" in DistributedConfig.__dataclass_fields__:
        return DistributedConfig(tp_plan=tensor, tp_size=size, ep_size=size, ep_plan=experts)
    covered = re.compile(rf"(?:{'|'.join(map(re.escape, experts))})(?:\..+)?").fullmatch
    return DistributedConfig(tp_plan={name: rule for name, rule in tensor.items() if not covered(name)} | experts,
                             tp_size=size)


# Per family, modules whose weights transformers ties to another module's (the first prefix's to the second's) while
# its plan names only the first (DiffusionGemma's encoder text layers and embedding are its decoder's:
# `DiffusionGemmaModel._tied_weights_keys`). transformers shards a tied weight once, under the first name, and then
# ties the first module to the second's whole weight, under the first's sharding hooks; so the second gets the same
# rules and the model loads untied and is tied after (`load_untied`). Tied to the sharded embedding, the LM head takes
# its vocabulary shards: transformers 5.17 names no rule for DiffusionGemma's (5.24: this one).
TIED_MODULES = {"diffusion_gemma": {"model.encoder.language_model.": "model.decoder."}}
TIED_LM_HEAD = {"lm_head": "colwise_gather_output"}


def meta_model(model_class, config, dtype=None):
    """A `model_class` (a model class or an auto class) of `config` on the meta device: its plans and sizes, no
    memory."""
    build = model_class.from_config if hasattr(model_class, "from_config") else model_class._from_config
    with torch.device("meta"):
        return build(config) if dtype is None else build(config, dtype=dtype)


def model_plans(model) -> tuple[dict[str, str], dict[str, str]]:
    """The TP and EP plans of `model` (`meta_model`), by full module name, with the rules of `TIED_MODULES` given to
    the modules tied to theirs."""
    config = model.config
    named = [*model.named_modules(remove_duplicate=False), *model.named_parameters(remove_duplicate=False)]
    names = {generic_name(name) for name, _ in named}

    def tied(plan: dict[str, str]) -> dict[str, str]:
        twins = {source + name[len(prefix):]: rule for name, rule in plan.items()
                 for prefix, source in TIED_MODULES.get(config.model_type, {}).items() if name.startswith(prefix)}
        return plan | {name: rule for name, rule in twins.items() if name in names}

    head = TIED_LM_HEAD if config.model_type in TIED_MODULES else {}
    return head | tied(dict(model._tp_plan or {})), tied(dict(model._ep_plan or {}))


def load_untied(load, config):
    """`load(config)`; a family of `TIED_MODULES` loads untied, each of its tied weights sharded by its own rules (the
    checkpoint holds the second module's), and is tied after: the first module takes the second's shards."""
    if config is None or config.model_type not in TIED_MODULES:
        return load(config)
    untied = copy.deepcopy(config)
    untied.tie_word_embeddings = False
    model = load(untied)
    model.config.tie_word_embeddings = config.tie_word_embeddings
    model.tie_weights()
    return model
