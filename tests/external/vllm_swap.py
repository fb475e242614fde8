"""pytest plugin (`-p vllm_swap`) that runs vLLM's own tests against this package instead of
vLLM's KV cache manager and attention backend. tests/external/test_vllm_external.py loads it in a
subprocess on the sources tests/external/fetch_vllm_tests.sh fetched.

- Every `KVCacheManager(...)` vLLM's tests or its Scheduler build is a `ChunkTreeKVCacheManager`
  over it; `Scheduler` / `AsyncScheduler` are our `ChunkAttnScheduler` /
  `ChunkAttnAsyncScheduler`; every scheduler first applies the plugin's
  start-up refusals, so a configuration the plugin never runs fails as it would at start-up.
- The attention-backend harness compares CPU_ATTN and CUSTOM with its SDPA reference.
- expected_failures.txt lists every test that does not simply pass, with its category and
  reason (see its header): most are strict xfails, so one that starts passing fails the run, as
  does any unlisted failure.
- The Hugging Face models the tests name are served offline from local configs (hub_configs.py).
- The few fixtures the tests take from vLLM's root conftest (not loaded: it needs vLLM's whole
  test environment) are defined here.

CHUNKATTN_EXT_SWAP=0 runs the same tests on stock vLLM (list not applied): to tell our failures
from the environment's. CHUNKATTN_EXT_REPORT=path writes the outcome of every test as JSON.
"""
from __future__ import annotations

import inspect
import json
import logging
import os
import re
from pathlib import Path

import pytest
import torch

from strip_internals import strip_internal_asserts

HERE = Path(__file__).resolve().parent
EXPECTED = HERE / "expected_failures.txt"
# refused / environment / internals / differs: strict xfail; internals-stripped: run without the
# asserts on internals (strip_internals.py), must pass; not run: deselected.
CATEGORIES = ("refused", "environment", "internals", "internals-stripped", "differs", "not run")
RELEASES = ("0.32.0", "0.33.0")      # the vLLM releases whose tests the list knows
SWAP = os.environ.get("CHUNKATTN_EXT_SWAP", "1") != "0"

USES = [0]       # tree managers and CUSTOM builders built so far: which tests exercised ours

# Before vLLM reads its environment: no hub access, hub names -> local config folders.
os.environ["HF_HUB_OFFLINE"] = "1"
if "VLLM_MODEL_REDIRECT_PATH" not in os.environ:
    from hub_configs import write_redirects
    models = HERE.parents[1] / ".cache" / "hub-configs"
    os.environ["VLLM_MODEL_REDIRECT_PATH"] = str(write_redirects(models))


# -- the swap -------------------------------------------------------------------------------------

def _install_swap() -> None:
    import vllm.v1.core.kv_cache_manager as kv_cache_manager
    import vllm.v1.core.sched.async_scheduler as async_module
    import vllm.v1.core.sched.scheduler as scheduler_module

    from vllm_chunkattn.plugin import register
    from vllm_chunkattn.plugin.kv_cache_manager import ChunkTreeKVCacheManager
    from vllm_chunkattn.plugin.scheduler import ChunkAttnAsyncScheduler, ChunkAttnScheduler
    from vllm_chunkattn.plugin.support import (kv_cache_config_refusals,
                                               refuse_tree_unsupported, tree_refusal)

    register()                           # CUSTOM -> ChunkAttnBackend, as the entry point does
    from vllm_chunkattn.plugin.backend import ChunkAttnMetadataBuilder
    builder_init = ChunkAttnMetadataBuilder.__init__

    def counted_builder_init(self, *args, **kwargs):
        builder_init(self, *args, **kwargs)
        USES[0] += 1

    ChunkAttnMetadataBuilder.__init__ = counted_builder_init
    stock_manager = kv_cache_manager.KVCacheManager
    stock_scheduler = scheduler_module.Scheduler

    class TreeKVCacheManager(ChunkTreeKVCacheManager):
        """Built with KVCacheManager's arguments: the stock manager, then the tree over it."""

        def __init__(self, *args, **kwargs):
            stock = stock_manager(*args, **kwargs)
            config = stock.kv_cache_config
            reasons = kv_cache_config_refusals(config)
            if stock.use_eagle:
                reasons.append("speculative decoding (lookahead slots have no tokens yet)")
            if reasons:
                raise tree_refusal(reasons)
            # The scheduler's block size, as ChunkAttnScheduler passes it (decode context
            # parallel multiplies the spec's).
            bound = inspect.signature(stock_manager).bind(*args, **kwargs).arguments
            block_size = bound.get("scheduler_block_size",
                                   config.kv_cache_groups[0].kv_cache_spec.block_size)
            super().__init__(stock, block_size)
            USES[0] += 1

    original_init = stock_scheduler.__init__

    def refusing_init(self, vllm_config, kv_cache_config, *args, **kwargs):
        # Any scheduler class (AsyncScheduler too): what the plugin refuses at start-up.
        refuse_tree_unsupported(vllm_config, kv_cache_config)
        original_init(self, vllm_config, kv_cache_config, *args, **kwargs)

    stock_scheduler.__init__ = refusing_init
    kv_cache_manager.KVCacheManager = TreeKVCacheManager
    scheduler_module.KVCacheManager = TreeKVCacheManager
    scheduler_module.Scheduler = ChunkAttnScheduler
    async_module.AsyncScheduler = ChunkAttnAsyncScheduler


def _attention_backends():
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    return ([AttentionBackendEnum.CPU_ATTN, AttentionBackendEnum.CUSTOM] if SWAP
            else [AttentionBackendEnum.CPU_ATTN])


def _adapt_attention_harness(module) -> None:
    """The harness's backend lists are module globals read at call time: CPU ones only. Its
    MockAttentionLayer lacks the `isa` CPU_ATTN's builder sets on the model's real layers
    (the harness has none): it reads the one the last CPU_ATTN builder chose."""
    for name in ("BACKENDS_TO_TEST", "NON_CAUSAL_BACKENDS_TO_TEST",
                 "SLIDING_WINDOW_BACKENDS_TO_TEST", "SLIDING_WINDOW_ENCODER_BACKENDS_TO_TEST"):
        if isinstance(getattr(module, name, None), list):
            getattr(module, name)[:] = _attention_backends()
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionMetadataBuilder
    original = CPUAttentionMetadataBuilder._set_isa_to_layers
    chosen = {}

    def set_isa_to_layers(self, layer_names):
        chosen["isa"] = self.isa
        original(self, layer_names)

    CPUAttentionMetadataBuilder._set_isa_to_layers = set_isa_to_layers
    module.MockAttentionLayer.isa = property(lambda layer: chosen["isa"])

    # The harness writes context K/V as logical C = [K | V]; CPU_ATTN's vec ISAs (all the
    # harness reaches: block 16, or CUSTOM's choice) keep K transposed, then V, per block/head.
    prepopulate = module.create_and_prepopulate_kv_cache

    def create_and_prepopulate_kv_cache(*args, **kwargs):
        cache = prepopulate(*args, **kwargs)
        if cache.dtype == torch.uint8:
            return cache                    # fp8: only for backends that support it
        from vllm_chunkattn.kv_layout import kv_cache_views
        cpu = torch.zeros(cache.shape, dtype=cache.dtype, device=cache.device)
        key, value = kv_cache_views(cpu, "cpu_attn")
        head_size = cache.shape[-1] // 2
        key.copy_(cache[..., :head_size].transpose(1, 2))
        value.copy_(cache[..., head_size:].transpose(1, 2))
        return cpu

    module.create_and_prepopulate_kv_cache = create_and_prepopulate_kv_cache
    # The harness builds impls directly; CUSTOM first gets the start-up check vLLM's selector
    # makes (through the plugin's CPU wrapper), so what it refuses there is refused here too.
    run = module.run_attention_backend

    def run_attention_backend(backend, kv_cache_spec, layer_names, vllm_config, device,
                              common_attn_metadata, *args, **kwargs):
        from vllm.platforms import current_platform
        from vllm.v1.attention.backends.registry import AttentionBackendEnum
        from vllm.v1.attention.selector import AttentionSelectorConfig
        if backend == AttentionBackendEnum.CUSTOM:
            current_platform.get_attn_backend_cls(backend, AttentionSelectorConfig(
                head_size=kv_cache_spec.head_size, dtype=kv_cache_spec.dtype,
                kv_cache_dtype=kwargs.get("kv_cache_dtype", "auto"),
                block_size=kv_cache_spec.block_size, has_sink=kwargs.get("sinks") is not None,
                attn_type=kwargs.get("attn_type", "decoder"),
                has_sliding_window=kwargs.get("sliding_window") is not None,
                use_non_causal=not common_attn_metadata.causal))
        return run(backend, kv_cache_spec, layer_names, vllm_config, device,
                   common_attn_metadata, *args, **kwargs)

    module.run_attention_backend = run_attention_backend
    # With torch >= 2.9 the causal test adds FLEX_ATTENTION (no CPU KV writes) at block 128;
    # the check gates nothing else on the CPU backends.
    module.is_torch_equal_or_newer = lambda version: False


# -- expected failures ----------------------------------------------------------------------------

def read_expected(release: str, path: Path = EXPECTED) -> dict[str, tuple[str, str]]:
    """`node id  # category: reason` per line -> {node id: (category, reason)}, the entries of
    vLLM `release`: a category followed by `[releases]` (`refused [0.33.0]: ...`) applies to
    those releases only, one without to every release."""
    expected = {}
    for line in path.read_text().splitlines():
        node, _, note = line.partition("#")
        if node.strip():
            head, _, reason = note.partition(":")
            category, _, scope = head.partition("[")
            releases = scope.rstrip().removesuffix("]").split() if scope else None
            assert category.strip() in CATEGORIES and set(releases or ()) <= set(RELEASES), \
                f"{path.name}: {line!r}"
            if releases is None or release in releases:
                expected[node.strip()] = (category.strip(), reason.strip())
    return expected


def installed_release() -> str:
    import vllm
    return vllm.__version__.split("+")[0]


def covers(entry: str, nodeid: str) -> bool:
    """An entry is a node id, where `*` matches anything; a bare test function also covers
    all its parametrizations."""
    if "*" in entry:
        return re.fullmatch(".*".join(map(re.escape, entry.split("*"))), nodeid) is not None
    return nodeid == entry or ("[" not in entry and nodeid.startswith(entry + "["))


class _Tally:
    def __init__(self, report_path: str | None):
        self.report_path = report_path
        self.expected = read_expected(installed_release()) if SWAP else {}
        self.used: set[str] = set()
        self.outcomes: dict[str, str] = {}
        self.messages: dict[str, str] = {}       # failed test -> first line of its error
        self.categories: dict[str, str] = {}     # listed test -> its category
        self.stripped: dict[str, int] = {}       # test -> internal asserts removed
        self.exercised: list[str] = []           # tests that built a tree manager or CUSTOM

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, config, items):
        for module in {item.module for item in items
                       if item.module.__name__.rpartition(".")[2] == "test_attention_backends"}:
            _adapt_attention_harness(module)
        kept, deselected = [], []
        for item in items:
            entry = next((e for e in self.expected if covers(e, item.nodeid)), None)
            if entry is None:
                kept.append(item)
                continue
            self.used.add(entry)
            category, reason = self.expected[entry]
            self.categories[item.nodeid] = category
            if category == "not run":
                deselected.append(item)
                continue
            kept.append(item)
            if category == "internals-stripped":
                item.obj, self.stripped[item.nodeid] = strip_internal_asserts(item.obj)
            else:
                raises = {"refused": (ValueError, NotImplementedError),
                          "differs": AssertionError}.get(category)
                item.add_marker(pytest.mark.xfail(strict=True, raises=raises,
                                                  reason=f"{category}: {reason}"))
        if deselected:
            config.hook.pytest_deselected(items=deselected)
            items[:] = kept

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_call(self, item):
        before = USES[0]
        yield
        if USES[0] > before:
            self.exercised.append(item.nodeid)

    def pytest_runtest_logreport(self, report):
        if report.when != "call" and report.outcome == "passed":
            return
        outcome = report.outcome
        if hasattr(report, "wasxfail"):
            outcome = "xfailed" if report.skipped else "xpassed"
        elif str(report.longrepr).startswith("[XPASS(strict)]"):
            outcome = "xpassed"
        if self.outcomes.get(report.nodeid, "passed") == "passed":
            self.outcomes[report.nodeid] = outcome
        crash = getattr(report.longrepr, "reprcrash", None)
        if outcome == "failed" and crash is not None:
            self.messages[report.nodeid] = crash.message.splitlines()[0][:300]

    def stale(self) -> list[str]:
        """Entries that matched no test (only meaningful when the whole selection ran)."""
        if os.environ.get("CHUNKATTN_EXT_CHECK_STALE") != "1":
            return []
        return sorted(set(self.expected) - self.used)

    def pytest_sessionfinish(self, session, exitstatus):
        if self.stale():
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
        if self.report_path:
            Path(self.report_path).write_text(json.dumps(
                {"swap": SWAP, "outcomes": self.outcomes, "categories": self.categories,
                 "stripped": self.stripped, "exercised": self.exercised,
                 "messages": self.messages,
                 "stale_entries": self.stale()}, indent=1))

    def pytest_terminal_summary(self, terminalreporter):
        if self.stale():
            terminalreporter.write_line(f"{EXPECTED.name} entries matching no test: "
                                        + ", ".join(self.stale()), red=True)


def pytest_configure(config):
    for marker in ("cpu_test", "skip_global_cleanup", "optional", "core_model", "slow_test"):
        config.addinivalue_line("markers", f"{marker}: vLLM's own marker")
    if SWAP:
        _install_swap()
    config.pluginmanager.register(_Tally(os.environ.get("CHUNKATTN_EXT_REPORT")), "vllm_tally")


# -- the fixtures vLLM's root conftest gives these tests ------------------------------------------

@pytest.fixture
def default_vllm_config():
    from vllm.config import VllmConfig, set_current_vllm_config
    config = VllmConfig()
    with set_current_vllm_config(config):
        yield config


@pytest.fixture
def temporary_enable_log_propagate():
    vllm_logger = logging.getLogger("vllm")
    previous, vllm_logger.propagate = vllm_logger.propagate, True
    yield
    vllm_logger.propagate = previous


@pytest.fixture
def caplog_vllm(temporary_enable_log_propagate, caplog):
    with caplog.at_level(logging.INFO):
        yield caplog
