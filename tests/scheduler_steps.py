"""The model's side of a scheduler step, for tests that drive vLLM's schedulers without an engine:
one sampled token for every request whose scheduled tokens reach its end (the earlier chunks of
a chunked prefill sample nothing), from a deterministic `sampled(request)`."""
from vllm.v1.outputs import ModelRunnerOutput


def sampled_output(scheduler_output, requests: dict, sampled) -> ModelRunnerOutput:
    ids = list(scheduler_output.num_scheduled_tokens)
    tokens = []
    for rid in ids:
        r = requests[rid]
        done = r.num_computed_tokens + r.num_output_placeholders >= r.num_tokens
        tokens.append([sampled(r)] if done else [])
    return ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                             sampled_token_ids=tokens, logprobs=None, prompt_logprobs_dict={},
                             pooler_output=[])
