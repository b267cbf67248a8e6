"""Which fields of a `BlockDiffusionConfig` the user set (`explicit_fields`): the precedence of the calling
conventions puts them above the preset and the model's `generation_config` (docs/architecture.md, "Calling
conventions")."""

from __future__ import annotations

import dataclasses
import functools

from .presets import PRESETS


def record_passed_fields(cls: type) -> None:
    """Wraps the dataclass `__init__` of `cls` to record the names of the fields passed as `_passed`. A copy made by
    `dataclasses.replace`, which passes every field, counts every field as set (the model's `generation_config` then
    decides nothing for it); `BlockDiffusionConfig.replace` records only the fields it changes."""
    dataclass_init = cls.__init__

    @functools.wraps(dataclass_init)
    def recording_init(self, *args, **kwargs):
        dataclass_init(self, *args, **kwargs)
        self._passed = frozenset([f.name for f in dataclasses.fields(self)][: len(args)]) | frozenset(kwargs)

    cls.__init__ = recording_init


def explicit_fields(config) -> frozenset[str]:
    """The fields of `config` passed (`_passed`) or unlike the default: the preset's value, or for a field the preset
    derives from another (Dream's block size from max_new_tokens) that other field's value in `config`."""
    base = type(config).from_preset(config.preset) if config.preset else type(config)()
    derived = PRESETS[config.preset].derived if config.preset in PRESETS else {}
    expected = {f.name: getattr(config if f.name in derived else base, derived.get(f.name, f.name))
                for f in dataclasses.fields(config)}
    return config._passed | {name for name, value in expected.items() if getattr(config, name) != value}
