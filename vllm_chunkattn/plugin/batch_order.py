"""The decode-first batch order CUSTOM asks for, answered in one vectorised check when it holds.

The builder sets reorder_batch_threshold = 1 (decode rows first, so every layer passes TPP one
contiguous slice of rows); stock CPU_ATTN does not, so only CUSTOM pays vLLM's model runner
calling reorder_batch_to_split_decodes_and_prefills every step: a dict lookup per request and
about fifteen small numpy calls (~0.09 ms a step for 32 requests on a 2-core Xeon, more than
the whole metadata build). In a step where every row decodes (one scheduled token, its prompt
done) that function moves nothing and returns False. install() wraps the name the V1 model
runner calls, in the worker where the builder runs, with that one case answered from
`num_computed_tokens >= num_prompt_tokens` over the batch; every other step goes to vLLM's own
function. Without the flag the builder never runs and nothing is wrapped.
"""
from __future__ import annotations

import functools


def install() -> None:
    """Idempotent. Leaves alone a vLLM whose V1 runner does not call the function by name."""
    try:
        from vllm.v1.worker import gpu_model_runner as runner_module
    except ImportError:
        return
    original = getattr(runner_module, "reorder_batch_to_split_decodes_and_prefills", None)
    if original is None or getattr(original, "_chunkattn_wrapped", False):
        return
    runner_module.reorder_batch_to_split_decodes_and_prefills = decode_first(original)


def decode_first(original):
    """`original` (vLLM's reorder) with the all-decode step answered without it."""
    @functools.wraps(original)
    def reorder(input_batch, scheduler_output, decode_threshold: int = 1) -> bool:
        num_reqs = len(input_batch.req_ids)
        # Every row is scheduled (the runner drops unscheduled ones first), with >= 1 token each:
        # a total of num_reqs means one token per row. A row whose prompt is done has context
        # (prompts have >= 1 token). Such rows are all "decode": nothing to move.
        if (decode_threshold >= 1 and num_reqs
                and scheduler_output.total_num_scheduled_tokens == num_reqs
                and (input_batch.num_computed_tokens_cpu[:num_reqs]
                     >= input_batch.num_prompt_tokens[:num_reqs]).all()):
            return False
        return original(input_batch, scheduler_output, decode_threshold)
    reorder._chunkattn_wrapped = True
    return reorder
