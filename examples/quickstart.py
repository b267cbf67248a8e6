"""Block-diffusion decoding on a tiny random Qwen3 (offline): the API in twenty lines."""

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

import hf_blockdiff
from hf_blockdiff import BlockDiffusionConfig

torch.manual_seed(0)
config = Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, initializer_range=0.5,
                     mask_token_id=127, block_size=4)
model = Qwen3ForCausalLM(config).eval()
prompts = torch.randint(0, 120, (2, 9))
attention_mask = torch.ones_like(prompts)
attention_mask[1, :4] = 0  # left padding
cfg = BlockDiffusionConfig(max_new_tokens=16, strategy="low_confidence_dynamic", threshold=0.5,
                           attention="block_causal", eos_token_id=[])
out = model.generate_multi_block(prompts, cfg, attention_mask=attention_mask, return_dict=True)
print("generated:", out.sequences[:, prompts.shape[1]:].tolist())
print(f"forwards: {out.num_forwards}, tokens per forward: {out.tokens_per_forward:.2f} (hf_blockdiff {hf_blockdiff.__version__})")
