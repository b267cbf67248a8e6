"""SDAR-MoE (SDAR-30B-A3B, `model_type: sdar_moe`): the Qwen3-MoE architecture, decoded block-causally like SDAR.

The checkpoint stores each expert separately (`mlp.experts.{e}.{gate,up,down}_proj.weight`, router `mlp.gate.weight`)
and routes Qwen3-MoE style: softmax over experts, top-k, renormalized when `norm_topk_prob`. transformers 5's
Qwen3-MoE keeps the experts fused (`mlp.experts.gate_up_proj`, `mlp.experts.down_proj`) and converts the per-expert
names at load time (and back at save time) with a conversion registered for its `model_type`;
`register_expert_conversion` gives `sdar_moe` the same conversion.
"""

from __future__ import annotations

from huggingface_hub.dataclasses import strict
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM, Qwen3MoeModel

from .attention import BlockCausalDecoder
from .experts import ReleasedExperts
from .released.checkpoint import CompleteCheckpoint, OwnDecoderLM, ReleasedConfig
from .released.calls import sdar_call


@strict
class SDARMoeConfig(ReleasedConfig, Qwen3MoeConfig):
    model_type = "sdar_moe"

    block_size: int = 4
    mask_token_id: int = 151669

    def to_dict(self):
        output = super().to_dict()
        # transformers 5 stores `num_experts` as `num_local_experts` (attribute_map); the released key is `num_experts`
        output["num_experts"] = output.pop("num_local_experts")
        return output


def moe_layers(config) -> list[int]:
    """Qwen3-MoE's rule for the layers with experts."""
    return [layer for layer in range(config.num_hidden_layers) if layer not in config.mlp_only_layers
            and config.num_experts > 0 and (layer + 1) % config.decoder_sparse_step == 0]


class SDARMoeModel(ReleasedExperts, CompleteCheckpoint, BlockCausalDecoder, Qwen3MoeModel):
    """Qwen3-MoE decoder whose plain forward is block-causal over blocks of `config.block_size`; SDAR's released
    call forms too."""

    config_class = SDARMoeConfig
    _released_call = staticmethod(sdar_call)
    moe_layers = staticmethod(moe_layers)


class SDARMoeForCausalLM(ReleasedExperts, CompleteCheckpoint, OwnDecoderLM, Qwen3MoeForCausalLM):
    """Qwen3-MoE causal LM on `SDARMoeModel`."""

    config_class = SDARMoeConfig
    _supports_flash_attn = False
    decoder_class = SDARMoeModel
    moe_layers = staticmethod(moe_layers)
    config_attributes = ("router_aux_loss_coef", "num_experts", "num_experts_per_tok")


def register_expert_conversion() -> None:
    """Give `sdar_moe` checkpoints Qwen3-MoE's per-expert <-> fused-expert weight conversion.

    The registry lives in `transformers.conversion_mapping`, which is not a documented API; its two functions used
    here have the same signature in 5.17 and 5.23. Registering by `model_type` is needed because transformers applies
    conversions to non-transformers classes only when they were registered explicitly. Idempotent (`overwrite=True`).
    """
    from transformers import conversion_mapping

    conversion = conversion_mapping.get_checkpoint_conversion_mapping(Qwen3MoeConfig.model_type)
    conversion_mapping.register_checkpoint_conversion_mapping(SDARMoeConfig.model_type, conversion, overwrite=True)
