"""The plan of a decode step: which KV chunks several rows share, in CSR (tpp_plan.py), built
from the block table once per step (build.py), reused while the sharing holds (cache.py), padded
to fixed capacities for CUDA graphs (capacity.py), sent to the device without a sync
(staging.py), with the partial states it needs (workspace.py). Imports no vLLM.
"""
from .build import build_plan, lexicographic_order
from .cache import PlanCache
from .capacity import PlanCapacity, pad_plan
from .staging import PlanStaging
from .tpp_plan import TppPlan, empty_plan
from .workspace import TppWorkspace

__all__ = ["TppPlan", "build_plan", "empty_plan", "lexicographic_order", "PlanCache",
           "PlanCapacity", "pad_plan", "PlanStaging", "TppWorkspace"]
