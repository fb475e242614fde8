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
                          if c.logprobs else None}
                         for c in o.outputs] for o in outs])
    json.dump({"groups": results}, open(out_path, "w"))


if __name__ == "__main__":
    main(*sys.argv[1:3])
