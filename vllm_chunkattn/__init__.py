"""vllm-chunkattn: ChunkAttention (prefix-aware KV cache + two-phase partition decode) for vLLM.

The core (plan, ops, decode, tree) imports no vLLM; `vllm_chunkattn.plugin` is the vLLM glue,
loaded by vLLM through the `vllm.general_plugins` entry point and selected with
`--attention-backend CUSTOM`. As a library: `TppDecodeWrapper` (decode.py) plans a batch once
and runs it per layer; `ChunkPrefixTree` (tree.py) hands out the block ids.
"""
__version__ = "0.1.0"

from .decode import TppDecodeWrapper, TppLaunch, tpp_decode  # noqa: E402
from .ops import tpp_decode_reference  # noqa: E402
from .plan import PlanCache, TppPlan, TppWorkspace, build_plan, empty_plan  # noqa: E402
from .tree import ChunkPrefixTree  # noqa: E402

__all__ = ["TppDecodeWrapper", "TppPlan", "build_plan", "empty_plan", "PlanCache", "TppLaunch",
           "TppWorkspace", "tpp_decode", "tpp_decode_reference", "ChunkPrefixTree",
           "__version__"]
