"""Calls from several threads on one model run one after another (a per-model lock): every output equals the same
call made alone, the model's attention setting and weights (a PEFT model's base weights too) end as they began, and
`commit_step` counts the forwards of its own call."""

import hashlib
import threading

import pytest
import torch

from hf_blockdiff import BlockDiffusionConfig

from helpers import MASK, left_pad, random_prompts, tiny_model

CFG = BlockDiffusionConfig(mask_token_id=MASK, block_size=4, max_new_tokens=8, attention="block_causal",
                           threshold=0.6, eos_token_id=[])


def weights_hash(model) -> str:
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def in_threads(model, jobs):
    """Run generate_multi_block for every (ids, mask, cfg) job at once, one thread each; results in job order."""
    results, errors = [None] * len(jobs), []
    barrier = threading.Barrier(len(jobs))

    def work(index, ids, mask, cfg):
        try:
            barrier.wait()
            results[index] = model.generate_multi_block(ids, cfg, attention_mask=mask, return_dict=True)
        except Exception as error:  # noqa: BLE001 (the test reports it)
            errors.append(error)

    threads = [threading.Thread(target=work, args=(i, *job)) for i, job in enumerate(jobs)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert not errors and not any(thread.is_alive() for thread in threads)
    return results


def jobs():
    """Prompts of different shapes and settings, so the calls would not share an engine."""
    return [(*left_pad(random_prompts(lengths, seed=seed)), CFG.replace(max_new_tokens=new))
            for seed, (lengths, new) in enumerate([((5, 9), 8), ((3,), 12), ((7, 4, 6), 8), ((11,), 4)])]


def test_threads_get_the_outputs_of_calls_made_alone():
    model = tiny_model("qwen3", seed=3)
    attention, before = model.config._attn_implementation, weights_hash(model)
    alone = [model.generate_multi_block(ids, cfg, attention_mask=mask, return_dict=True) for ids, mask, cfg in jobs()]
    together = in_threads(model, jobs())
    for a, b in zip(alone, together):
        assert torch.equal(a.sequences, b.sequences) and torch.equal(a.commit_step, b.commit_step)
    assert model.config._attn_implementation == attention and weights_hash(model) == before
    model(torch.tensor([[1, 2, 3]]))  # a plain forward still runs


def test_threads_on_a_peft_model_leave_no_adapter_merged():
    peft = pytest.importorskip("peft")
    torch.manual_seed(1)
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    model = peft.get_peft_model(tiny_model("qwen3", seed=4), lora)
    before = weights_hash(model)
    alone = [model.generate_multi_block(ids, cfg, attention_mask=mask, return_dict=True) for ids, mask, cfg in jobs()]
    together = in_threads(model, jobs())
    assert all(torch.equal(a.sequences, b.sequences) for a, b in zip(alone, together))
    assert weights_hash(model) == before
    assert not any(getattr(layer, "merged_adapters", None) for layer in model.modules())


def test_commit_step_counts_within_the_call(qwen3):
    ids, mask = left_pad(random_prompts((5, 9), seed=2))
    first, second = (qwen3.generate_multi_block(ids, CFG, attention_mask=mask, return_dict=True) for _ in range(2))
    assert torch.equal(first.commit_step, second.commit_step)
    assert int(first.commit_step.min()) >= 1 and int(first.commit_step.max()) <= first.num_forwards
