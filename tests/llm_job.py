"""Child process for tests: builds one vLLM LLM from a JSON job, runs its request groups in
order, writes token ids / logprobs as JSON. Usage: llm_job.py JOB.json OUT.json"""
import json
import sys


def main(job_path: str, out_path: str) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    job = json.load(open(job_path))
    llm = LLM(**job["engine"])
    results = []
    for group in job["groups"]:
        if group.get("reset_prefix_cache"):
            results.append({"reset_prefix_cache": bool(llm.reset_prefix_cache())})
            continue
        params = SamplingParams(**group["sampling"])
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in group["prompts"]], params)
        results.append([[{"token_ids": list(c.token_ids),
                          "logprobs": [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)]
                          if c.logprobs else None,
                          # each prompt token's logprob given the tokens before it
                          **({"prompt_logprobs": [lp[t].logprob for lp, t in zip(
                              o.prompt_logprobs[1:], o.prompt_token_ids[1:])]}
                             if o.prompt_logprobs else {})}
                         for c in o.outputs] for o in outs])
    out = {"groups": results}
    if job.get("metrics"):      # vLLM's own counters by name (needs disable_log_stats=False)
        out["metrics"] = {m.name: m.value for m in llm.get_metrics()
                          if m.name in job["metrics"] and hasattr(m, "value")}
    if job.get("kv_events_replay"):
        out["kv_events"] = replayed_kv_events(job["kv_events_replay"])
    json.dump(out, open(out_path, "w"))


def replayed_kv_events(endpoint: str, settle_s: float = 1.0) -> list[list]:
    """Every KV event batch the engine published, asked back from its ZMQ publisher's replay
    socket (vLLM's protocol: a start sequence number, then batches up to an end marker), once
    its publisher thread has had time to send the last step's. Events as JSON lists."""
    import time

    import msgspec
    import zmq
    from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch

    time.sleep(settle_s)
    socket = zmq.Context.instance().socket(zmq.DEALER)
    socket.connect(endpoint)
    socket.send_multipart((b"", (0).to_bytes(8, "big")))
    decoder, batches = msgspec.msgpack.Decoder(type=KVEventBatch), []
    while socket.poll(10_000):
        _, topic, _, payload = socket.recv_multipart()
        if not topic and not payload:
            break                                           # the end marker
        batch = decoder.decode(payload)
        events = []
        for e in batch.events:
            if isinstance(e, BlockStored):
                events.append(["stored", e.block_hashes, e.parent_block_hash, e.token_ids,
                               e.block_size, e.medium, e.kv_cache_spec_kind])
            elif isinstance(e, BlockRemoved):
                events.append(["removed", e.block_hashes])
            else:
                events.append(["cleared"])
        batches.append({"rank": batch.data_parallel_rank, "events": events})
    socket.close(linger=0)
    return batches


if __name__ == "__main__":
    main(*sys.argv[1:3])
