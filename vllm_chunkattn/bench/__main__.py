"""python -m vllm_chunkattn.bench {kernel,verify,ab,offline,sched,capacity,plan,ablation,soak,step,tpot,host,router} ...: each subcommand is a module with main(argv)."""
import importlib
import sys

COMMANDS = {
    "kernel": "vllm_chunkattn.bench.kernel",   # TPP kernel vs vLLM CPU_ATTN / torch baselines
    "verify": "vllm_chunkattn.bench.kernel_verify",  # the kernel on verify rows (k drafts) vs CPU_ATTN
    "plan": "vllm_chunkattn.bench.plan",       # plan build / rebuild cost
    "sched": "vllm_chunkattn.bench.sched",     # scheduler step time, peak KV blocks (tree vs stock)
    "capacity": "vllm_chunkattn.bench.window_capacity",  # requests held, sliding-window models
    "ab": "vllm_chunkattn.bench.ab",           # vllm bench serve: stock vs --attention-backend CUSTOM
    "offline": "vllm_chunkattn.bench.offline",  # LLM.generate decode tok/s: stock vs CUSTOM
    "ablation": "vllm_chunkattn.bench.ablation",  # serving: CUSTOM with each suspect switched off
    "soak": "vllm_chunkattn.bench.soak",       # CUSTOM server under faults, then checked vs stock
    "step": "vllm_chunkattn.bench.step_profile",  # one decode step: in-process vs multiprocess engine
    "tpot": "vllm_chunkattn.bench.tpot_model",  # decode TPOT from measured parts, stock vs CUSTOM
    "host": "vllm_chunkattn.bench.host_step",  # a served step's parts, timed where called
    "router": "vllm_chunkattn.bench.router",   # CUSTOM replicas behind vllm-router, per policy
}


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:
        print(f"usage: python -m vllm_chunkattn.bench {{{','.join(COMMANDS)}}} [--help]")
        return 2
    return importlib.import_module(COMMANDS[argv[0]]).main(argv[1:]) or 0


if __name__ == "__main__":
    sys.exit(main())
