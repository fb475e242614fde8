"""Tests that drive vLLM's schedulers without an engine: their config, and the model's side of a
scheduler step, one sampled token for every request whose scheduled tokens reach its end (the earlier chunks of
a chunked prefill sample nothing), from a deterministic `sampled(request)`."""
from collections import deque

from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request

from vllm_runs import tiny_model


def scheduler_config(block_size: int, num_blocks: int, max_num_batched_tokens: int,
                     max_num_seqs: int, async_scheduling: bool) -> VllmConfig:
    """A VllmConfig for driving a scheduler alone: the tiny model, prefix caching on, a pool of
    num_blocks (async scheduling set directly: vLLM's CPU platform would turn it off)."""
    config = VllmConfig(model_config=ModelConfig(model=str(tiny_model()), dtype="float32"),
                        cache_config=CacheConfig(block_size=block_size,
                                                 enable_prefix_caching=True),
                        scheduler_config=SchedulerConfig(
                            max_num_batched_tokens=max_num_batched_tokens,
                            max_num_seqs=max_num_seqs, max_model_len=1024,
                            is_encoder_decoder=False))
    config.scheduler_config.async_scheduling = async_scheduling
    config.cache_config.num_gpu_blocks = num_blocks
    return config


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


def run_waves(scheduler, waves, block_size: int, sampled, async_scheduling: bool,
              after_schedule=None, after_update=None) -> dict:
    """Each wave's requests (id, prompt, max_tokens) arrive when the previous wave has finished;
    with async scheduling two steps are in flight (EngineCore's batch queue). Returns per-step
    scheduled tokens, the KV cache usage vLLM reports as each step is scheduled (what /metrics
    samples), each request's output tokens and prefix hit (tokens), and the preemptions.
    after_schedule(scheduler) / after_update(requests): checks run after each of those."""
    hash_fn = get_hash_fn_by_name("sha256")
    init_none_hash(hash_fn)
    hasher = get_request_block_hasher(block_size, hash_fn)
    steps, usage, requests, hits = [], [], {}, {}

    def schedule():
        out = scheduler.schedule()
        usage.append(round(scheduler.kv_cache_manager.usage, 9))
        if after_schedule is not None:
            after_schedule(scheduler)
        return out

    for wave in waves:
        for rid, prompt, max_tokens in wave:
            requests[rid] = Request(rid, prompt, SamplingParams(max_tokens=max_tokens,
                                                                ignore_eos=True),
                                    None, block_hasher=hasher)
            scheduler.add_request(requests[rid])
        in_flight = deque([schedule()] + ([schedule()] if async_scheduling else []))
        while in_flight:
            out = in_flight.popleft()
            steps.append(dict(out.num_scheduled_tokens))
            for new in out.scheduled_new_reqs:       # admitted: its prefix hit, in tokens
                hits.setdefault(new.req_id, new.num_computed_tokens)
            scheduler.update_from_output(out, sampled_output(out, requests, sampled))
            if after_update is not None:
                after_update(requests)
            nxt = schedule()
            if nxt.num_scheduled_tokens:
                in_flight.append(nxt)
        assert scheduler.get_num_unfinished_requests() == 0
    return {"steps": steps, "usage": usage, "hits": hits,
            "outputs": {rid: list(r.output_token_ids) for rid, r in requests.items()},
            "preempted": sum(r.num_preemptions for r in requests.values())}
