"""Hugging Face calling conventions of `generate_multi_block` and `generate` (docs/architecture.md): keywords that
override config fields, a `transformers.GenerationConfig` as config, and the model's `generation_config` as the
checkpoint's defaults. Precedence, highest first: keyword > the config's `explicit_fields` > preset > the model's
`generation_config` > config defaults and the model profile."""

from __future__ import annotations

import dataclasses
import difflib

from transformers import GenerationConfig
from transformers.utils import logging

from ..config import BlockDiffusionConfig
from ..config.presets import PRESETS, preset_pins
from ..config.runtime import RUNTIME_FIELDS

logger = logging.get_logger(__name__)

CALL_ARGUMENTS = ("attention_mask", "streamer", "generator", "return_dict", "num_return_sequences", "adapters",
                  "return_dict_in_generate", "tokenizer", "stop_strings")
# call arguments a GenerationConfig sets
CONFIG_CALL_ARGUMENTS = ("num_return_sequences", "return_dict_in_generate", "stop_strings")
CHECKPOINT_FIELDS = ("max_new_tokens", "repetition_penalty")  # taken from the checkpoint whether or not it samples
SAMPLING = ("temperature", "top_k", "top_p")
IGNORED = ("bos_token_id", "transformers_version", "_from_model_config", "use_cache")
# named arguments of transformers' `generate`: taken at the values that turn nothing on (None, False), refused by name
# otherwise; disable_compile=True (TRL passes it) is compile=False
GENERATE_ARGUMENTS = ("synced_gpus", "assistant_model", "assistant_tokenizer", "prefix_allowed_tokens_fn",
                      "stopping_criteria", "negative_prompt_ids", "negative_prompt_attention_mask",
                      "use_model_defaults", "custom_generate", "disable_compile")
REFUSED = dict(max_length="pass max_new_tokens (block diffusion generates a fixed number of new tokens)")
FIELDS = (*(field.name for field in dataclasses.fields(BlockDiffusionConfig)), *RUNTIME_FIELDS)  # runtime's flat
GENERATION_DEFAULTS = GenerationConfig()


def _global_defaults() -> dict:
    return GenerationConfig._get_default_generation_params()


def _is_no_op(name: str, value) -> bool:
    return name in IGNORED or value is False or _global_defaults().get(name, object()) == value


def hf_fields(values: dict, source: str) -> dict:
    """BlockDiffusionConfig fields of transformers generation parameters `values` (keywords or a GenerationConfig's
    set fields): do_sample=False is greedy (temperature 0), do_sample=True stays as `do_sample` (`merged_config`
    fills the sampling parameters left unset); a parameter block diffusion does not take is refused."""
    fields = {"compile": False} if values.get("disable_compile") and "compile" not in values else {}
    for name, value in values.items():
        if name == "disable_compile" or value is None and (name not in FIELDS or hasattr(GENERATION_DEFAULTS, name)):
            continue  # None is transformers' "unset", for a generation parameter as in `generate`
        if name in REFUSED:
            raise ValueError(f"{source} {name}={value!r} is not supported: {REFUSED[name]}.")
        if name in FIELDS or name == "do_sample":
            fields[name] = value
        elif not _is_no_op(name, value):
            raise ValueError(f"{source} {name}={value!r}: block-diffusion decoding does not support it; leave it "
                             "unset (return_dict_in_generate=True returns logprobs and entropies of the tokens).")
    sample, temperature = fields.pop("do_sample", None), fields.get("temperature")
    if sample is False and temperature not in (None, 0):
        raise ValueError(f"{source} do_sample=False and temperature={temperature}: pass temperature=0 for greedy "
                         "decoding, or do_sample=True to sample.")
    if sample and temperature == 0:
        raise ValueError(f"{source} do_sample=True and temperature=0: pass a positive temperature to sample, or "
                         "do_sample=False for greedy decoding.")
    if sample is False:
        fields["temperature"] = 0.0
    return {**fields, "do_sample": True} if sample else fields


def checkpoint_fields(model, sampling: bool) -> dict:
    """What the model's `generation_config` sets, as `generate` reads it: max_new_tokens and repetition_penalty, and
    with `sampling` the sampling parameters. eos/pad ids reach the config through the model profile."""
    generation = getattr(model, "generation_config", None)
    names = (*CHECKPOINT_FIELDS, *(SAMPLING if sampling else ()))
    return {name: getattr(generation, name) for name in names if getattr(generation, name, None) is not None}


def call_arguments(config, kwargs: dict) -> dict:
    """num_return_sequences, return_dict (return_dict_in_generate) and stop_strings set by a GenerationConfig
    `config` or by keywords (which win), and the `tokenizer` keyword (stop strings need it), taken out of
    `kwargs`."""
    given = config.to_diff_dict() if isinstance(config, GenerationConfig) else {}
    call = {name: given[name] for name in CONFIG_CALL_ARGUMENTS if name in given}
    call.update({name: kwargs.pop(name) for name in CONFIG_CALL_ARGUMENTS if name in kwargs})
    return {"num_return_sequences": call.get("num_return_sequences", 1),
            "return_dict": bool(call.get("return_dict_in_generate")), "stop_strings": call.get("stop_strings"),
            "tokenizer": kwargs.pop("tokenizer", None)}


def split_call(config, kwargs: dict) -> tuple[BlockDiffusionConfig | None, dict, dict]:
    """(the BlockDiffusionConfig passed or None, the fields a passed GenerationConfig set, the fields of the
    keywords), after refusing unknown keywords with the close names."""
    if config is not None and not isinstance(config, (BlockDiffusionConfig, GenerationConfig)):
        raise TypeError("config must be a BlockDiffusionConfig or a transformers GenerationConfig (or None to use "
                        "the model's profile and generation_config).")
    known = (*FIELDS, *CALL_ARGUMENTS, *GENERATE_ARGUMENTS)
    for name in kwargs:
        if name not in known and not hasattr(GENERATION_DEFAULTS, name):
            close = difflib.get_close_matches(name, known)
            hint = f"did you mean {', '.join(close)}?" if close else "see BlockDiffusionConfig for the fields"
            raise ValueError(f"generate_multi_block got an unknown keyword {name!r}: {hint}")
    keywords = {k: v for k, v in kwargs.items() if k not in CALL_ARGUMENTS}
    if not isinstance(config, GenerationConfig):
        return config, {}, hf_fields(keywords, "keyword")
    set_fields = {k: v for k, v in config.to_diff_dict().items() if k not in CONFIG_CALL_ARGUMENTS}
    # merged before they are read, keywords winning, as `generate` merges them (do_sample=True over the
    # GenerationConfig's do_sample=False samples at its temperature)
    return None, hf_fields(_layered(set_fields, keywords), "GenerationConfig and keywords"), {}


def _layered(*sources: dict) -> dict:
    """The fields of `sources`, lowest precedence first. A source's do_sample=True turns sampling on over a lower
    source's temperature 0, do_sample=False a lower source's temperature off; a source's temperature 0 turns a
    lower source's do_sample=True off."""
    chosen = {}
    for fields in sources:
        if fields.get("do_sample") and "temperature" not in fields and chosen.get("temperature") == 0:
            del chosen["temperature"]
        if fields.get("do_sample") is False and "temperature" not in fields:
            chosen.pop("temperature", None)  # greedy over a lower source's temperature
        if fields.get("temperature") == 0:
            chosen.pop("do_sample", None)
        chosen.update(fields)
    return chosen


def merged_config(model, config, kwargs: dict) -> BlockDiffusionConfig:
    """The config of one call, by the precedence of the module docstring. Sampling is on when the call says
    do_sample=True, or when the checkpoint's `generation_config` does and the call chose no temperature 0; then the
    sampling parameters left unset come from the checkpoint, else transformers' defaults (temperature 1, top_k 50,
    top_p 1), as in `generate`. A warning (once per distinct decision) says what the checkpoint decided."""
    config, generation, keywords = split_call(config, kwargs)
    explicit = {name: getattr(config, name) for name in config.explicit_fields} if config is not None else {}
    chosen = _layered(explicit, generation, keywords)
    preset = chosen.pop("preset", None)
    pins = preset_pins(preset) if preset in PRESETS else {}
    sample = chosen.pop("do_sample", False)
    checkpoint_samples = bool(getattr(getattr(model, "generation_config", None), "do_sample", False))
    sampling = sample or (checkpoint_samples and chosen.get("temperature") != 0)
    decided = {k: v for k, v in checkpoint_fields(model, sampling).items() if k not in chosen and k not in pins}
    defaults = {name: _global_defaults()[name] for name in SAMPLING if sampling and name not in chosen}
    if sampling and not sample:  # the checkpoint turned sampling on: its defaults are its decision too
        decided = {**defaults, **decided}
    if decided:
        logger.warning_once(f"the model's generation_config decided {_listed(decided)}; pass them to override "
                            "(docs/architecture.md, \"Calling conventions\").")
    if config is not None and not generation and not keywords and not decided and not defaults:
        return config
    fields = {**defaults, **decided, **chosen}
    return BlockDiffusionConfig.from_preset(preset, **fields) if preset else BlockDiffusionConfig(**fields)


def sampling_fields(model, given: dict) -> dict:
    """temperature, top_k and top_p of a request that says do_sample=True: `given`'s, else the model's
    `generation_config`'s, else transformers' defaults (what `generate` samples with)."""
    checkpoint = checkpoint_fields(model, sampling=True)
    return {name: given.get(name, checkpoint.get(name, _global_defaults()[name])) for name in SAMPLING}


def as_given(config: BlockDiffusionConfig) -> BlockDiffusionConfig:
    """`config` with every field the model's `generation_config` could decide marked as set, so that a call decodes
    with `config`'s own values (the bench and the demo decode what their flags say)."""
    return config.replace(**{name: getattr(config, name) for name in (*CHECKPOINT_FIELDS, *SAMPLING)})


def _listed(fields: dict) -> str:
    return ", ".join(f"{name}={value!r}" for name, value in sorted(fields.items()))
