"""The paged KV cache (`PagedBlockCache`, a `transformers.Cache`) and the cache keyword of the installed transformers
(docs/architecture.md, "The cache")."""

from .paged_cache import ForwardPlan, PagedBlockCache

__all__ = ["ForwardPlan", "PagedBlockCache"]
