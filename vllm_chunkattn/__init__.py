"""vllm-chunkattn: ChunkAttention (prefix-aware KV cache + two-phase partition decode) for vLLM.

The core (plan, ops, tree) imports no vLLM; `vllm_chunkattn.plugin` is the vLLM glue, loaded by
vLLM through the `vllm.general_plugins` entry point and selected with `--attention-backend CUSTOM`.
"""
__version__ = "0.1.0"

from .ops import tpp_decode, tpp_decode_reference  # noqa: E402
from .plan import TppPlan, build_plan, empty_plan  # noqa: E402
from .plan_cache import PlanCache  # noqa: E402

__all__ = ["TppPlan", "build_plan", "empty_plan", "PlanCache", "tpp_decode",
           "tpp_decode_reference", "__version__"]
