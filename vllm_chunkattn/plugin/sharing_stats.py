"""Per-worker decode sharing counters: logged periodically and, when CHUNKATTN_STATS_FILE is set,
written there as JSON (the worker is a separate process; this is how demos and tests read it).

CHUNKATTN_STATS_INTERVAL_S: seconds between log lines / file writes (default 10; 0 = every step).
The KV token counters also go to /metrics every step, from one worker per engine
(plugin/prometheus.py).
"""
from __future__ import annotations

import json
import os
import time

from . import logger
from .prometheus import MetricsWriter


class SharingStats:
    def __init__(self):
        self.interval_s = float(os.environ.get("CHUNKATTN_STATS_INTERVAL_S", "10"))
        self.path = os.environ.get("CHUNKATTN_STATS_FILE")
        self.decode_steps = self.decode_rows = self.kv_tokens = self.shared_kv_tokens = 0
        self.max_shared_kv_tokens_per_step = 0
        self.plan_builds = 0
        self.mixed_steps = 0          # steps with decode rows and (chunked-)prefill rows
        self._last = time.monotonic()
        self._writer = None

    def publish_to_metrics(self, vllm_config) -> None:
        """Every rank of an engine plans the same decode batch: the first one speaks for all."""
        from vllm.distributed.parallel_state import (get_pp_group,
                                                     get_tensor_model_parallel_rank,
                                                     model_parallel_is_initialized)
        first = not model_parallel_is_initialized() or (
            get_tensor_model_parallel_rank() == 0 and get_pp_group().is_first_rank)
        if self._writer is None and first:
            self._writer = MetricsWriter.for_process(vllm_config,
                                                     ("kv_tokens", "shared_kv_tokens"))

    def record(self, num_rows: int, kv_tokens: int, shared_kv_tokens: int, plan_builds: int,
               with_prefill: bool):
        self.decode_steps += 1
        self.mixed_steps += with_prefill
        self.decode_rows += num_rows
        self.kv_tokens += kv_tokens
        self.shared_kv_tokens += shared_kv_tokens
        self.max_shared_kv_tokens_per_step = max(self.max_shared_kv_tokens_per_step,
                                                 shared_kv_tokens)
        self.plan_builds = plan_builds
        if self._writer:
            self._writer.write(vars(self))
        if time.monotonic() - self._last >= self.interval_s:
            self.flush()

    def as_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if not k.startswith("_")
                and k not in ("interval_s", "path")}

    def flush(self) -> None:
        self._last = time.monotonic()
        saved = self.shared_kv_tokens / self.kv_tokens if self.kv_tokens else 0.0
        logger.info("chunkattn decode: steps=%d rows=%d kv_tokens=%d shared_kv_tokens=%d (%.1f%% "
                    "of decode KV reads served by shared chunks), plan builds=%d",
                    self.decode_steps, self.decode_rows, self.kv_tokens, self.shared_kv_tokens,
                    100 * saved, self.plan_builds)
        if self.path:
            tmp = f"{self.path}.{os.getpid()}.tmp"
            with open(tmp, "w") as f:
                json.dump(self.as_dict(), f)
            os.replace(tmp, self.path)   # readers never see a half-written file


SHARING_STATS = SharingStats()
