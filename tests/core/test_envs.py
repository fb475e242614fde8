"""vllm_chunkattn/envs.py, the one registry of CHUNKATTN_* knobs: typed reads, the generated
docs/configuration.md, and that no code reads or names a knob the registry does not hold."""
import ast
import re
from pathlib import Path

import pytest

from vllm_chunkattn import envs

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "configuration.md"
REGENERATE = ".venv/bin/python -m vllm_chunkattn.envs --markdown > docs/configuration.md"

# Where a CHUNKATTN_* name may appear: the names found there must all be registered.
SCANNED = ("csrc", "setup.py", "vllm_chunkattn", ".ci", "tests", "benchmarks", "examples",
           "docs", "Makefile", "README.md")
TEXT_SUFFIXES = {"", ".py", ".sh", ".md", ".txt", ".toml", ".cfg", ".c", ".h", ".cpp", ".cu",
                 ".cuh"}
SKIPPED_DIRS = {"__pycache__", "wheels"}      # benchmarks/gpu/wheels: downloaded, not ours
NAME = re.compile(r"CHUNKATTN_(?:[A-Z0-9_]|\{[A-Z0-9_,]+\})*")   # {A,B}: both


def test_docs_are_the_registry():
    assert DOC.is_file() and DOC.read_text() == envs.markdown(), (
        f"docs/configuration.md is not what the registry generates: run `{REGENERATE}`")


def test_every_knob_is_documented_and_well_formed():
    text = envs.markdown()
    for short, k in envs.KNOBS.items():
        assert k.name == envs.PREFIX + short and f"`{k.name}`" in text
        assert k.kind in envs.KINDS and k.doc and set(k.read_by) <= set(envs.READERS)
        assert "\n" not in k.doc, k.name            # one table row each
    assert len(envs.KNOBS) == len({k.name for k in envs.KNOBS.values()})


# --- typed reads ---

def test_bools_default_and_override(monkeypatch):
    monkeypatch.delenv("CHUNKATTN_TREE_KV_MANAGER", raising=False)
    monkeypatch.delenv("CHUNKATTN_DEBUG_TREE", raising=False)
    assert envs.TREE_KV_MANAGER is True and envs.DEBUG_TREE is False
    monkeypatch.setenv("CHUNKATTN_TREE_KV_MANAGER", "0")
    monkeypatch.setenv("CHUNKATTN_DEBUG_TREE", "1")
    assert envs.TREE_KV_MANAGER is False and envs.DEBUG_TREE is True    # read at each access
    monkeypatch.setenv("CHUNKATTN_TREE_KV_MANAGER", "")                 # empty: the default
    assert envs.TREE_KV_MANAGER is True


def test_numbers_paths_and_choices(monkeypatch, tmp_path):
    monkeypatch.delenv("CHUNKATTN_SCHED_WINDOW", raising=False)
    monkeypatch.delenv("CHUNKATTN_STATS_INTERVAL_S", raising=False)
    monkeypatch.delenv("CHUNKATTN_STATS_FILE", raising=False)
    monkeypatch.delenv("CHUNKATTN_CPU_ISA", raising=False)
    assert envs.SCHED_WINDOW == 256 and envs.SCHED_MAX_WAIT_STEPS == 64
    assert envs.STATS_INTERVAL_S == 10.0 and envs.STATS_FILE is None and envs.CPU_ISA == ""
    monkeypatch.setenv("CHUNKATTN_SCHED_WINDOW", "8")
    monkeypatch.setenv("CHUNKATTN_STATS_INTERVAL_S", "0.5")
    monkeypatch.setenv("CHUNKATTN_STATS_FILE", str(tmp_path / "s.json"))
    monkeypatch.setenv("CHUNKATTN_CPU_ISA", "avx2")
    assert envs.SCHED_WINDOW == 8 and envs.STATS_INTERVAL_S == 0.5
    assert envs.STATS_FILE == tmp_path / "s.json" and envs.CPU_ISA == "avx2"


def test_a_computed_default(monkeypatch, tmp_path):
    monkeypatch.delenv("CHUNKATTN_BUILD_DIR", raising=False)
    assert envs.BUILD_DIR == Path.home() / ".cache" / "vllm_chunkattn" / "jit"
    monkeypatch.setenv("CHUNKATTN_BUILD_DIR", str(tmp_path))
    assert envs.BUILD_DIR == tmp_path


@pytest.mark.parametrize("name,value,expected", [
    ("SCHED_WINDOW", "many", "expected an int"),
    ("STATS_INTERVAL_S", "10s", "expected a number"),
    ("DEBUG_TREE", "yes", "expected a bool, 1 or 0"),
    ("CPU_ISA", "sse2", "expected one of amx, avx512_bf16, avx512, avx2, scalar"),
])
def test_a_bad_value_names_the_knob_and_the_type(monkeypatch, name, value, expected):
    monkeypatch.setenv(envs.PREFIX + name, value)
    with pytest.raises(ValueError) as e:
        getattr(envs, name)
    assert str(e.value) == f"{envs.PREFIX}{name}={value!r}: {expected}"


def test_unknown_names_are_errors():
    with pytest.raises(AttributeError):
        envs.NOT_A_KNOB
    with pytest.raises(KeyError, match="not a registered knob"):
        envs.knob("NOT_A_KNOB")
    assert envs.knob("CHUNKATTN_SCHED_WINDOW") is envs.knob("SCHED_WINDOW")


def test_raw_and_export(monkeypatch):
    monkeypatch.delenv("CHUNKATTN_OVERLAP_FINAL", raising=False)
    assert envs.raw("OVERLAP_FINAL", "default") == "default"
    monkeypatch.setenv("CHUNKATTN_METRICS_DIR", "before")     # restored after the test
    envs.export("METRICS_DIR", "some/dir")
    assert envs.raw("CHUNKATTN_METRICS_DIR") == "some/dir" and envs.METRICS_DIR == Path("some/dir")


def test_the_command_line_prints_the_docs(capsys):
    assert envs.main(["--markdown"]) == 0
    assert capsys.readouterr().out == envs.markdown()
    assert envs.main([]) == 0
    assert "CHUNKATTN_SCHED_WINDOW=" in capsys.readouterr().out


# --- nothing reads around the registry, nothing is named outside it ---

def _is_environ(node) -> bool:
    """os.environ, or a bare `environ` (from os import environ)."""
    return ((isinstance(node, ast.Attribute) and node.attr == "environ")
            or (isinstance(node, ast.Name) and node.id == "environ"))


def direct_reads(source: str) -> list[str]:
    """The CHUNKATTN_* variables `source` reads through os.environ / os.getenv, by literal name or
    through a module-level string constant."""
    tree = ast.parse(source)
    constants = {t.id: n.value.value for n in tree.body if isinstance(n, ast.Assign)
                 and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str)
                 for t in n.targets if isinstance(t, ast.Name)}

    def knob_name(node):
        value = node.value if isinstance(node, ast.Constant) else constants.get(
            getattr(node, "id", None))
        return value if isinstance(value, str) and value.startswith(envs.PREFIX) else None

    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args:
            f = node.func
            reads = ((isinstance(f, ast.Attribute) and f.attr == "getenv")
                     or (isinstance(f, ast.Name) and f.id == "getenv")
                     or (isinstance(f, ast.Attribute) and f.attr in ("get", "setdefault", "pop")
                         and _is_environ(f.value)))
            if reads and (name := knob_name(node.args[0])):
                found.append(name)
        elif (isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load)
              and _is_environ(node.value) and (name := knob_name(node.slice))):
            found.append(name)
        elif (isinstance(node, ast.Compare) and any(_is_environ(c) for c in node.comparators)
              and (name := knob_name(node.left))):
            found.append(name)
    return found


def test_the_scan_finds_direct_reads():
    source = ('import os\nfrom os import environ, getenv\nENV = "KNOB_B"\n'
              'a = os.environ.get("KNOB_A", "1")\nb = os.environ[ENV]\n'
              'c = os.getenv("KNOB_C")\nd = "KNOB_D" in os.environ\n'
              'e = environ.get("KNOB_E")\nf = getenv("KNOB_F")\n'
              'os.environ["KNOB_G"] = "1"\nh = os.environ.get("HOME")\n'
              'env = {**os.environ, "KNOB_I": "0"}\n').replace("KNOB_", envs.PREFIX)
    assert sorted(direct_reads(source)) == [envs.PREFIX + c for c in "ABCDEF"]


def test_only_the_registry_reads_knobs():
    offenders = {}
    for path in sorted((ROOT / "vllm_chunkattn").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel == "vllm_chunkattn/envs.py":
            continue
        if names := direct_reads(path.read_text()):
            offenders[rel] = names
    assert not offenders, f"read these through vllm_chunkattn.envs instead: {offenders}"


def _expand(name: str) -> list[str]:
    """CHUNKATTN_{CHUNK,SEQ}_SPLITS -> both names."""
    m = re.search(r"\{([^{}]*)\}", name)
    if not m:
        return [name]
    return [n for alt in m.group(1).split(",")
            for n in _expand(name[:m.start()] + alt + name[m.end():])]


def _scanned_files():
    for top in SCANNED:
        path = ROOT / top
        files = [path] if path.is_file() else sorted(path.rglob("*"))
        for f in files:
            if (f.is_file() and f.suffix in TEXT_SUFFIXES
                    and not SKIPPED_DIRS & set(f.relative_to(ROOT).parts)):
                yield f


def test_every_name_in_the_sources_is_registered():
    # Names #define'd in csrc/ are preprocessor macros, not environment variables.
    macros = {m for f in (ROOT / "csrc").rglob("*") if f.is_file()
              for m in re.findall(r"#define\s+(CHUNKATTN_\w+)", f.read_text(errors="replace"))}
    assert "CHUNKATTN_SIMT_EMULATION" in macros                     # the scan sees csrc/
    known = [k.name for k in envs.KNOBS.values()]
    unknown = {}
    for f in _scanned_files():
        for raw_name in NAME.findall(f.read_text(errors="replace")):
            for name in _expand(raw_name):
                if name in macros or name.endswith("_") and any(   # a prefix: CHUNKATTN_ISA_<x>
                        k.startswith(name) for k in [*macros, *known]):
                    continue
                if name.removeprefix(envs.PREFIX) not in envs.KNOBS:
                    unknown.setdefault(name, f.relative_to(ROOT).as_posix())
    assert not unknown, f"register these in vllm_chunkattn/envs.py: {unknown}"


def test_the_native_kernels_knobs_are_registered():
    """Each std::getenv name in csrc/ (also through env_int) is a registered native-kernel knob."""
    read = {n for f in (ROOT / "csrc").rglob("*") if f.is_file() for n in re.findall(
        r"(?:getenv|env_int)\(\"(CHUNKATTN_\w+)\"\)", f.read_text(errors="replace"))}
    assert {"CHUNKATTN_CPU_ISA", "CHUNKATTN_OVERLAP_FINAL", "CHUNKATTN_CHUNK_SPLITS"} <= read
    for name in read:
        assert "native kernel" in envs.knob(name).read_by, name
