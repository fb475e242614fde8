"""The plan of a decode step: which KV chunks several rows share, in CSR (tpp_plan.py), built
from the block table once per step (build.py), reused while the sharing holds (cache.py), padded
to fixed capacities for CUDA graphs (capacity.py), sent to the device without a sync
(staging.py), with the partial states it needs (workspace.py); rows of several query tokens
become one row per token (query_rows.py). Imports no vLLM.
"""
from .build import build_plan, lexicographic_order
from .cache import PlanCache
from .capacity import PlanCapacity, pad_plan
from .query_rows import query_rows
from .staging import PlanStaging
from .tpp_plan import TppPlan, empty_plan
from .workspace import TppWorkspace

__all__ = ["TppPlan", "build_plan", "empty_plan", "lexicographic_order", "PlanCache",
           "PlanCapacity", "pad_plan", "PlanStaging", "TppWorkspace", "query_rows"]
