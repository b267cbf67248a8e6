"""lm-evaluation-harness model `hf-blockdiff`: `generate_until` tasks decoded with `generate_multi_block`.

Importing this module registers the model with lm-eval. lm-eval (released versions up to 0.5.0.dev1) fills its model
registry from its own source tree only, with no plugin entry points, so the bare `lm_eval` command cannot see a model
from another package. `hf-blockdiff lm-eval ARGS` runs lm-eval's command line with the model registered, ARGS as
for `lm_eval`:

    hf-blockdiff lm-eval --model hf-blockdiff --tasks gsm8k --device cuda --batch_size 32 \\
        --model_args pretrained=PATH,dtype=bfloat16,block_size=4,strategy=low_confidence_dynamic,threshold=0.9

From Python: `import hf_blockdiff.integrations.lm_eval`, then `lm_eval.simple_evaluate(model="hf-blockdiff", ...)`.

model_args: `pretrained` (checkpoint directory), `dtype`, `preset` (a `BlockDiffusionConfig` preset) and any
`BlockDiffusionConfig` field with a scalar value. Per request, `max_gen_toks` sets max_new_tokens, the text is cut
before the first `until` string, and `do_sample=True` takes the request's temperature/top_p/top_k; a request without
it (lm-eval's greedy tasks) decodes greedily unless model_args set a temperature, whatever the checkpoint's
generation_config says. Log-likelihood
requests are refused: diffusion decoding does not score a given continuation.
"""

from __future__ import annotations

import dataclasses
import sys

from lm_eval.api.model import LM
from lm_eval.api.registry import register_model

from ..config import BlockDiffusionConfig
from ..generation.hf_conventions import sampling_fields
from .checkpoint import load_pretrained
from .completions import complete

CONFIG_FIELDS = sorted(f.name for f in dataclasses.fields(BlockDiffusionConfig))
UNSUPPORTED = ("hf-blockdiff: {} is not supported for diffusion decoding (it scores given continuations); "
               "run generate_until tasks (e.g. gsm8k, humaneval).")


@register_model("hf-blockdiff")
class BlockDiffusionLM(LM):
    def __init__(self, pretrained: str, dtype: str = "auto", device: str | None = None, batch_size: int | str = 16,
                 preset: str | None = None, **decoding):
        super().__init__()
        unknown = sorted(set(decoding) - set(CONFIG_FIELDS))
        if unknown:
            raise ValueError(f"hf-blockdiff: unknown model_args {unknown}; pass pretrained, dtype, device, preset or "
                             f"BlockDiffusionConfig fields: {', '.join(CONFIG_FIELDS)}.")
        if not str(batch_size).isdigit() or int(batch_size) < 1:
            raise ValueError(f"hf-blockdiff: batch_size={batch_size!r}; pass a positive number (no 'auto').")
        self.config = (BlockDiffusionConfig.from_preset(preset, **decoding) if preset
                       else BlockDiffusionConfig(**decoding))
        self.model, self.tokenizer = load_pretrained(pretrained, device, dtype)
        self.batch_size = int(batch_size)
        self._rank, self._world_size, self._device = 0, 1, self.model.device

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Requests with the same generation arguments are decoded together, in batches of `batch_size`."""
        groups: dict[str, list[int]] = {}
        for index, request in enumerate(requests):
            groups.setdefault(repr(sorted(request.args[1].items())), []).append(index)
        texts: list[str] = [""] * len(requests)
        for indices in groups.values():
            config, stops = self._request_config(requests[indices[0]].args[1])
            contexts = [requests[i].args[0] for i in indices]
            completions = complete(self.model, contexts, config, self.tokenizer, batch_size=self.batch_size,
                                   progress=not disable_tqdm)
            for index, completion in zip(indices, completions):
                texts[index] = cut(completion.text, stops)
                self.cache_hook.add_partial("generate_until", requests[index].args, texts[index])
        return texts

    def _request_config(self, gen_kwargs: dict) -> tuple[BlockDiffusionConfig, list[str]]:
        changes = {"max_new_tokens": int(gen_kwargs.get("max_gen_toks", self.config.max_new_tokens))}
        if gen_kwargs.get("do_sample"):  # as HFLM's generate: unset sampling parameters from the checkpoint
            changes.update(sampling_fields(self.model, gen_kwargs))
        elif "temperature" not in self.config.explicit_fields:  # greedy, whatever the checkpoint's generation_config
            changes["temperature"] = 0.0
        until = gen_kwargs.get("until") or []
        return self.config.replace(**changes), [until] if isinstance(until, str) else list(until)

    def loglikelihood(self, requests, disable_tqdm: bool = False):
        raise NotImplementedError(UNSUPPORTED.format("loglikelihood"))

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
        raise NotImplementedError(UNSUPPORTED.format("loglikelihood_rolling"))


def cut(text: str, stops: list[str]) -> str:
    """`text` up to the first occurrence of any of `stops`."""
    return text[: min((i for i in (text.find(s) for s in stops if s) if i >= 0), default=len(text))]


def run_cli(args: list[str]) -> None:
    """lm-eval's command line on `args`, with `hf-blockdiff` registered."""
    from lm_eval.__main__ import cli_evaluate

    sys.argv = ["lm-eval", *args]
    cli_evaluate()
