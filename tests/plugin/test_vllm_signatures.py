"""Our overrides against vLLM's interfaces, by signature, for every vLLM the `cuda` extra allows:
the installed one (0.32) and 0.33, read from its sources (tests/vllm_sources.py fetches them
from the sdist; skipped with the reason when they cannot be fetched). Nothing of 0.33 is
imported: its files are parsed (ast); ours are inspected.

- every call the Scheduler makes on its kv_cache_manager binds to ChunkTreeKVCacheManager's own
  method, with the positional and keyword arguments that version passes;
- every method of vLLM's we override (manager, scheduler, backend) accepts whatever vLLM's
  accepts, and we define every abstract one;
- the attributes the scheduler reads on the manager, ChunkAttnScheduler's overrides and the
  scheduler state it reads, the CommonAttentionMetadata fields our builder reads, the model
  runners' block-table state plugin/host_block_table.py reads, the platform methods the plugin
  wraps, and every name the plugin imports from vLLM still exist."""
import ast
import inspect
from pathlib import Path

import pytest
from vllm_sources import vllm_sources

pytest.importorskip("vllm")

import vllm
from vllm.v1.core.kv_cache_manager import KVCacheManager

from vllm_chunkattn.plugin import backend, host_block_table, scheduler
from vllm_chunkattn.plugin.kv_cache_manager import ChunkTreeKVCacheManager

pytestmark = pytest.mark.vllm
PLUGIN = Path(scheduler.__file__).parent
# The bench modules that drive vLLM's managers and engine the way the plugin does.
BENCH_VLLM_DRIVERS = [PLUGIN.parent / "bench" / "kv_manager_sim.py",
                      PLUGIN.parent / "bench" / "sched_admission.py"]
VERSIONS = ["installed", "0.33.0"]
# Our class -> (vLLM file, vLLM base class) whose methods it overrides.
OVERRIDES = {
    ChunkTreeKVCacheManager: ("v1/core/kv_cache_manager.py", "KVCacheManager"),
    scheduler.ChunkTreeScheduling: ("v1/core/sched/scheduler.py", "Scheduler"),
    backend.ChunkAttnBackend: ("v1/attention/backend.py", "AttentionBackend"),
    backend.ChunkAttnMetadataBuilder: ("v1/attention/backend.py", "AttentionMetadataBuilder"),
    backend.ChunkAttnImpl: ("v1/attention/backend.py", "AttentionImpl"),
}
# Never called by vLLM: ChunkAttnScheduler builds the tree manager from vLLM's own.
NOT_CALLED = {(ChunkTreeKVCacheManager, "__init__")}
# vLLM attributes ChunkAttnScheduler reads on itself.
SCHEDULER_STATE = ("current_step", "waiting", "running", "max_num_running_reqs", "requests",
                   "block_size", "kv_cache_manager")


@pytest.fixture(scope="module", params=VERSIONS)
def vllm_root(request) -> Path:
    if request.param == "installed":
        return Path(vllm.__file__).parent
    return vllm_sources(request.param) / "pkg" / "vllm"


def parse(root: Path, relative: str) -> ast.Module:
    return ast.parse((root / relative).read_text())


def find_class(module: ast.Module, name: str) -> ast.ClassDef:
    return next(n for n in module.body if isinstance(n, ast.ClassDef) and n.name == name)


def methods(cls: ast.ClassDef) -> dict[str, ast.FunctionDef]:
    return {n.name: n for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


def self_attributes(cls: ast.ClassDef) -> set[str]:
    """Names assigned as self.X anywhere in the class, plus its class-level names."""
    names = set(methods(cls))
    for node in ast.walk(cls):
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        for t in targets:
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) \
                    and t.value.id == "self":
                names.add(t.attr)
            elif isinstance(t, ast.Name) and node in cls.body:
                names.add(t.id)
    return names


def incompatibility(theirs: ast.FunctionDef, ours, order_only: bool = False) -> str | None:
    """Why a call that vLLM's signature accepts may fail on ours (None: it cannot). Ours may
    add parameters with defaults. order_only: only the positional parameters' order."""
    params = list(inspect.signature(ours).parameters.values())
    a = theirs.args
    positional = [x.arg for x in a.posonlyargs + a.args]
    ours_positional = [p.name for p in params
                       if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    n = min(len(ours_positional), len(positional))
    if ours_positional[:n] != positional[:n] or len(ours_positional) < len(positional) and \
            not any(p.kind is p.VAR_POSITIONAL for p in params):
        return f"positional parameters {ours_positional} vs vLLM's {positional}"
    if order_only or any(p.kind is p.VAR_POSITIONAL for p in params) and \
            any(p.kind is p.VAR_KEYWORD for p in params):
        return None                                         # the rest passes through
    theirs_optional = {x.arg for x in (a.posonlyargs + a.args)[len(positional) - len(a.defaults):]}
    theirs_optional |= {x.arg for x, d in zip(a.kwonlyargs, a.kw_defaults) if d is not None}
    for p in params:
        required = p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        if required and (p.name in theirs_optional or p.name not in positional
                         and p.name not in {x.arg for x in a.kwonlyargs}):
            return f"{p.name} is required by ours, optional or absent in vLLM's"
    ours_names = {p.name for p in params}
    missing = [x.arg for x in a.kwonlyargs if x.arg not in ours_names]
    return f"keyword-only {missing} missing" if missing else None


def kv_cache_manager_uses(root: Path) -> tuple[list[tuple[str, int, tuple, int]], set[str]]:
    """The scheduler's calls on self.kv_cache_manager (method, #positional, keywords, line), and
    the attributes it reads there without calling."""
    tree = parse(root, "v1/core/sched/scheduler.py")
    calls, called, read = [], set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner = node.func.value
            if isinstance(owner, ast.Attribute) and owner.attr == "kv_cache_manager":
                assert not any(isinstance(a, ast.Starred) for a in node.args), node.lineno
                calls.append((node.func.attr, len(node.args),
                              tuple(k.arg for k in node.keywords), node.lineno))
                called.add(id(node.func))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and id(node) not in called and \
                isinstance(node.value, ast.Attribute) and node.value.attr == "kv_cache_manager":
            read.add(node.attr)
    return calls, read


def test_every_call_of_the_scheduler_binds_to_the_tree_managers_own_method(vllm_root):
    calls, _ = kv_cache_manager_uses(vllm_root)
    assert {"get_computed_blocks", "allocate_slots", "free"} <= {c[0] for c in calls}
    problems = []
    for name, num_args, keywords, line in calls:
        if name not in ChunkTreeKVCacheManager.__dict__:
            problems.append(f"l.{line} {name}: inherited from KVCacheManager, not ours")
            continue
        try:
            inspect.signature(getattr(ChunkTreeKVCacheManager, name)).bind(
                None, *range(num_args), **dict.fromkeys(keywords))
        except TypeError as e:
            problems.append(f"l.{line} {name}({num_args} positional, {keywords}): {e}")
    assert problems == [], problems


def test_our_overrides_accept_what_vllms_methods_accept(vllm_root):
    problems = []
    for ours, (relative, base) in OVERRIDES.items():
        theirs = methods(find_class(parse(vllm_root, relative), base))
        problems += [f"{ours.__name__}.{name}: abstract in vLLM, not ours"
                     for name, f in theirs.items() if name not in vars(ours) and any(
                         getattr(d, "id", getattr(d, "attr", "")) == "abstractmethod"
                         for d in f.decorator_list)]
        for name, value in vars(ours).items():
            func = value.__func__ if isinstance(value, (classmethod, staticmethod)) else value
            if name in theirs and inspect.isfunction(func) and (ours, name) not in NOT_CALLED:
                # vLLM's callers pass every constructor argument (its own impls require them
                # too): only their order must match.
                why = incompatibility(theirs[name], func, order_only=name == "__init__")
                if why:
                    problems.append(f"{ours.__name__}.{name}: {why}")
    assert problems == [], problems


def test_what_the_scheduler_reads_and_we_override_still_exists(vllm_root):
    _, read = kv_cache_manager_uses(vllm_root)
    manager = self_attributes(find_class(parse(vllm_root, "v1/core/kv_cache_manager.py"),
                                         "KVCacheManager"))
    assert sorted(read - manager - set(ChunkTreeKVCacheManager.__dict__)) == []
    sched = self_attributes(find_class(parse(vllm_root, "v1/core/sched/scheduler.py"),
                                       "Scheduler"))
    overridden = {n for n, v in vars(scheduler.ChunkTreeScheduling).items()
                  if inspect.isfunction(v) and not n.startswith("_order")}
    assert sorted((overridden | set(SCHEDULER_STATE)) - sched) == []


def test_every_vllm_name_the_plugin_imports_exists(vllm_root):
    missing = []
    for path in [*sorted(PLUGIN.glob("*.py")), *BENCH_VLLM_DRIVERS]:
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.ImportFrom) and node.module
                    and node.module.split(".")[0] == "vllm"):
                continue
            parts = node.module.split(".")[1:]
            candidates = [Path(*parts[:-1], parts[-1] + ".py")] if parts else []
            module = next((vllm_root / p for p in [*candidates, Path(*parts, "__init__.py")]
                           if (vllm_root / p).exists()), None)
            if module is None:
                missing.append(f"{path.name}: module {node.module}")
                continue
            defined = top_level_names(ast.parse(module.read_text()))
            for alias in node.names:
                if alias.name not in defined and not (module.parent / alias.name).exists() \
                        and not (module.parent / f"{alias.name}.py").exists():
                    missing.append(f"{path.name}: {node.module}.{alias.name}")
    assert missing == [], missing
    registry = find_class(parse(vllm_root, "v1/attention/backends/registry.py"),
                          "AttentionBackendEnum")
    assert "CUSTOM" in self_attributes(registry)             # the slot register() fills


def test_the_metadata_fields_our_builder_reads_exist(vllm_root):
    fields = self_attributes(find_class(parse(vllm_root, "v1/attention/backend.py"),
                                        "CommonAttentionMetadata"))
    read = set()
    for path in (backend.__file__, host_block_table.__file__):
        read |= {n.attr for n in ast.walk(ast.parse(Path(path).read_text()))
                 if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
                 and n.value.id in ("cm", "common_attn_metadata")}
    assert {"block_table_tensor", "seq_lens", "slot_mapping", "req_idx",
            "seq_lens_cpu_upper_bound"} <= read
    assert sorted(read - fields) == []


def test_the_runner_state_the_host_block_table_reads_exists(vllm_root):
    """plugin/host_block_table.py reads the model runners' block tables on the host: V1's
    BlockTable.block_table (a CpuGpuBuffer), V2's BlockTables, whose append_block_ids it follows
    and whose num_blocks.np must hold the row's new end when that returns."""
    def attributes(relative, cls):
        return self_attributes(find_class(parse(vllm_root, relative), cls))
    assert "block_table" in attributes("v1/worker/block_table.py", "BlockTable")
    assert {"gpu", "cpu", "np"} <= attributes("v1/utils.py", "CpuGpuBuffer")
    v2 = find_class(parse(vllm_root, "v1/worker/gpu/block_table.py"), "BlockTables")
    assert {"block_tables", "input_block_tables", "num_blocks",
            "redirect_writes_to_null_block"} <= self_attributes(v2)
    assert "gpu" in attributes("v1/worker/gpu/buffer_utils.py", "StagedWriteTensor")
    assert "np" in attributes("v1/worker/gpu/buffer_utils.py", "UvaBackedTensor")
    append = methods(v2)["append_block_ids"]
    assert [a.arg for a in append.args.args] == ["self", "req_index", "new_block_ids",
                                                 "overwrite"]
    sets_end = [n for n in ast.walk(append) if isinstance(n, ast.Assign)
                and ast.unparse(n.targets[0]) == "self.num_blocks.np[i, req_index]"]
    assert [ast.unparse(n.value) for n in sets_end] == ["end"]


def test_the_platform_methods_the_plugin_wraps_keep_their_signatures(vllm_root):
    """plugin/__init__.py wraps these and calls the originals with these arguments."""
    wrapped = {("platforms/cpu.py", "CpuPlatform", "get_attn_backend_cls"):
               ["cls", "selected_backend", "attn_selector_config", "num_heads"],
               ("platforms/cpu.py", "CpuPlatform", "check_and_update_config"):
               ["cls", "vllm_config"],
               ("platforms/cuda.py", "CudaPlatformBase", "check_and_update_config"):
               ["cls", "vllm_config"]}
    found = {key: [a.arg for a in methods(find_class(parse(vllm_root, key[0]), key[1]))[
        key[2]].args.args] for key in wrapped}
    assert found == wrapped


def test_the_config_fields_the_start_up_refusals_read_exist(vllm_root):
    """plugin/support.py (config_refusals, tree_config_refusals) reads these where the config is
    built;
    it mirrors vLLM's rule that CacheConfig.sliding_window is set only when every layer
    slides (EngineArgs.create_engine_config), so that rule is checked too."""
    def attributes(relative, cls):
        return self_attributes(find_class(parse(vllm_root, relative), cls))
    assert {"hf_text_config", "get_sliding_window", "use_mla", "is_encoder_decoder"} <= \
        attributes("config/model.py", "ModelConfig")
    assert {"sliding_window", "cache_dtype"} <= attributes("config/cache.py", "CacheConfig")
    assert {"model_config", "cache_config", "attention_config", "scheduler_config",
            "speculative_config", "kv_transfer_config", "kv_events_config"} <= \
        attributes("config/vllm.py", "VllmConfig")
    if (vllm_root / "config" / "aux_output.py").exists():                # vLLM 0.33
        assert "aux_output_config" in attributes("config/vllm.py", "VllmConfig")
        assert "enabled" in methods(find_class(parse(vllm_root, "config/aux_output.py"),
                                               "AuxOutputConfig"))
    create = methods(find_class(parse(vllm_root, "engine/arg_utils.py"), "EngineArgs"))[
        "create_engine_config"]
    rule = [ast.unparse(n.test) for n in ast.walk(create) if isinstance(n, ast.If)
            and "layer_types" in ast.unparse(n.test)]
    assert rule == ["layer_types is None or all((lt == 'sliding_attention' for lt in "
                    "layer_types))"], rule


def test_the_fa3_call_of_bench_tpot_binds_to_vllms_flash_attn(vllm_root):
    """bench/vllm_flash_attn.py calls vLLM's FA3 entry points by keyword, as FLASH_ATTN does:
    every keyword it passes is a parameter of that version's function."""
    from vllm_chunkattn.bench import vllm_flash_attn
    theirs = {f.name: f for f in parse(vllm_root, "vllm_flash_attn/flash_attn_interface.py").body
              if isinstance(f, ast.FunctionDef)}
    ours = [n for n in ast.walk(ast.parse(Path(vllm_flash_attn.__file__).read_text()))
            if isinstance(n, ast.Call) and getattr(n.func, "id", "") in theirs]
    assert sorted({c.func.id for c in ours}) == ["flash_attn_varlen_func",
                                                 "get_scheduler_metadata"]
    for call in ours:
        a = theirs[call.func.id].args
        params = {x.arg for x in a.posonlyargs + a.args + a.kwonlyargs}
        assert not call.args, f"{call.func.id}: positional arguments"
        assert sorted({k.arg for k in call.keywords} - params) == [], call.func.id


def top_level_names(module: ast.Module) -> set[str]:
    names = set()
    for node in module.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, ast.If):                       # TYPE_CHECKING / platform branches
            names |= top_level_names(ast.Module(body=node.body + node.orelse, type_ignores=[]))
    return names
