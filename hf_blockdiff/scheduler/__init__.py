"""The model-free half of a decode step: decode state, window policies, strategies' decisions
(docs/architecture.md, "Architecture"). Nothing here imports transformers, torch.nn or model code."""

from .chunks import Chunks, plan_chunks
from .scheduler import ActiveBlocks, ForwardLayout, Scheduler, ScoreRequest
from .state import BlockStatus, DecodeState, Decision, geometry
from .windows import StoreDecision, Stored, WindowPolicy, window_policy

__all__ = ["ActiveBlocks", "BlockStatus", "Chunks", "DecodeState", "Decision", "ForwardLayout", "Scheduler",
           "ScoreRequest", "StoreDecision", "Stored", "WindowPolicy", "geometry", "plan_chunks", "window_policy"]
