"""The per-model lock: calls on one model from several threads (offline calls, the live engine's steps) run one
after another instead of sharing its decode engine, its attention setting and its merged weights."""

from __future__ import annotations

import threading
import weakref

_LOCKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> its lock (copies of it get their own)
_LOCKS_GUARD = threading.Lock()


def model_lock(model) -> threading.RLock:
    """The lock of the weights `model` decodes with (a PEFT model and its base model share it)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    with _LOCKS_GUARD:
        return _LOCKS.setdefault(base, threading.RLock())
