"""Which of transformers' experts modules a CUDA graph can capture (docs/fidelity.md, "MoE experts under CUDA graphs").

transformers' decorated experts modules dispatch on `config._experts_implementation`. Graph capture forbids reading a
device value on the host, and three of those paths do:
- `grouped_mm` on weights other than bfloat16: torch.compile routes them to transformers' fallback loop, which reads
  the group offsets on the host;
- `grouped_mm` with a single expert: the offsets come from `torch.histc(bins=1, min=0, max=0)`, and a histogram whose
  range is empty reads the data's range on the host;
- `eager` (and undecorated modules): the loop over the experts that were hit asks the host which ones.
`batched_mm` and bfloat16 `grouped_mm` over several experts capture on the GPUs measured here (H100, H200; transformers
may still fall back to its loop on GPUs without grouped GEMMs); other implementations are not known to capture.
"""

from __future__ import annotations

import torch


def experts_capture_blocker(model) -> str | None:
    """Why a CUDA graph cannot capture the model's experts (None: it can, or the model has no experts modules)."""
    for name, module in model.named_modules():
        weight = getattr(module, "gate_up_proj", None)
        weight = getattr(module, "up_proj", None) if weight is None else weight  # experts without a gate
        if not (hasattr(module, "num_experts") and isinstance(weight, torch.Tensor)):
            continue
        implementation = getattr(getattr(module, "config", None), "_experts_implementation", None) or "eager"
        if implementation == "batched_mm":
            continue
        if implementation == "eager":
            return (f"`{name}` runs transformers' eager experts, which ask the host which experts were hit; call "
                    "model.set_experts_implementation('grouped_mm') (bfloat16) or 'batched_mm'")
        if implementation != "grouped_mm":
            return (f"`{name}` runs {implementation!r} experts, which CUDA graphs are not known to capture; call "
                    "model.set_experts_implementation('batched_mm') to decode with graphs")
        if module.num_experts == 1:
            return (f"`{name}` has a single expert, whose grouped-GEMM offsets transformers counts with a histogram "
                    "that reads its range on the host; call model.set_experts_implementation('batched_mm')")
        if weight.dtype != torch.bfloat16:
            return (f"`{name}` holds {weight.dtype} weights, which transformers' grouped GEMMs run through a loop "
                    "reading the offsets on the host; use bfloat16 weights or call "
                    "model.set_experts_implementation('batched_mm')")
    return None
