"""The KV cache's keyword across transformers versions (docs/fidelity.md, "Model families").

transformers 5.24 renamed the cache keyword of model and layer forwards, of the mask utilities and of the model
outputs from `past_key_values` to `cache`; the old name still works there with a FutureWarning and goes in 5.40.
5.17 knows only `past_key_values`. The patched families and the fused layer forwards take either name
(`kv_cache_argument`; the released scripts pass `past_key_values`) and pass the cache on under the installed version's
name (`CACHE_KEYWORD`), so their own calls warn on no version.
"""

from __future__ import annotations

import inspect

from transformers.masking_utils import create_causal_mask

CACHE_KEYWORD = "cache" if "cache" in inspect.signature(create_causal_mask).parameters else "past_key_values"


def kv_cache_argument(past_key_values, kwargs: dict):
    """The KV cache a forward was given: transformers ≥ 5.24 passes it as `cache`, earlier versions and the released
    scripts as `past_key_values`; `cache` is taken out of `kwargs`."""
    cache = kwargs.pop("cache", None)
    return past_key_values if past_key_values is not None else cache


def cache_kwarg(cache) -> dict:
    """`cache` under the installed version's keyword, for a stock forward, mask utility or model output."""
    return {CACHE_KEYWORD: cache}
