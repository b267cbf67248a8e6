"""Train a tiny block-diffusion model with a real `Trainer` and watch `BlockDiffusionEvalCallback` score its
generations at every evaluation (offline, CPU, well under a minute).

Task: the answer is the prompt's last token, four times. Training uses the masked-diffusion objective: mask a
random share of the answer, predict the masked tokens in place (no shift), under the block-causal attention that
decoding uses (a token sees its own block and the blocks before it), passed to the model as a 4D mask.
With several processes (`torchrun --nproc_per_node 2 examples/train_with_eval_callback.py`) the eval prompts are
split between them.
"""

import argparse

import torch
import torch.nn.functional as F
from transformers import Qwen3Config, Qwen3ForCausalLM, Trainer, TrainingArguments

from hf_blockdiff import BlockDiffusionConfig, BlockDiffusionEvalCallback

VOCAB, MASK, PROMPT, ANSWER, BLOCK = 32, 31, 8, 4, 4
BLOCK_CAUSAL = (torch.arange(PROMPT + ANSWER)[None, :] // BLOCK <= torch.arange(PROMPT + ANSWER)[:, None] // BLOCK)


def examples(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    prompts = torch.randint(0, MASK, (n, PROMPT), generator=torch.Generator().manual_seed(seed))
    return prompts, prompts[:, -1:].repeat(1, ANSWER)


class MaskedAnswers(torch.utils.data.Dataset):
    """prompt + answer with a random share of the answer masked; labels only at the masked positions."""

    def __init__(self, n: int, seed: int):
        self.prompts, self.answers = examples(n, seed)

    def __len__(self):
        return len(self.prompts)

    def __getitem__(self, i):
        answer = self.answers[i]
        masked = torch.rand(ANSWER) < torch.rand(()).clamp(min=0.1)
        labels = torch.cat([torch.full((PROMPT,), -100), answer.masked_fill(~masked, -100)])
        return {"input_ids": torch.cat([self.prompts[i], answer.masked_fill(masked, MASK)]), "labels": labels,
                "attention_mask": BLOCK_CAUSAL[None]}


def masked_diffusion_loss(outputs, labels, num_items_in_batch=None):
    return F.cross_entropy(outputs.logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--output-dir", default="/tmp/hf_blockdiff_example")
    args = parser.parse_args()

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, mask_token_id=MASK,
                         block_size=BLOCK)
    model = Qwen3ForCausalLM(config)
    eval_prompts, eval_answers = examples(16, seed=1)
    callback = BlockDiffusionEvalCallback(
        prompts=eval_prompts.tolist(),
        references=eval_answers.tolist(),  # token ids: scored by exact match of the generated ids
        config=BlockDiffusionConfig(max_new_tokens=ANSWER, eos_token_id=[]),
    )
    training = TrainingArguments(
        output_dir=args.output_dir, max_steps=args.steps, per_device_train_batch_size=32, learning_rate=1e-2,
        eval_strategy="steps", eval_steps=max(args.steps // 3, 1), logging_steps=max(args.steps // 3, 1),
        save_strategy="no", report_to="none", use_cpu=True,
    )
    trainer = Trainer(model=model, args=training, train_dataset=MaskedAnswers(2048, seed=0),
                      eval_dataset=MaskedAnswers(64, seed=2), compute_loss_func=masked_diffusion_loss,
                      callbacks=[callback])
    trainer.train()
    if trainer.is_world_process_zero():
        for entry in trainer.state.log_history:
            if "eval_blockdiff_accuracy" in entry:
                print(f"step {entry['step']:>3}: accuracy {entry['eval_blockdiff_accuracy']:.2f}, "
                      f"{entry['eval_blockdiff_tokens_per_forward']:.2f} tokens/forward")


if __name__ == "__main__":
    main()
