# tests/test_settings.py: accelerate_c/base/settings.py owns the ACCELERATE_C_* variables. Read from the code:
# os.environ / getenv appear only in the allowed modules, no module but settings names one of our variables,
# every variable the code, C sources, docs and tests mention is in the table, docs/configuration.md is the
# table's generated text. Then the parser (each bad value a named error, each good value round-trips), the
# accessors for other programs' variables, native_options, and a bad value stopping Accelerator construction.
from __future__ import annotations

import ast
import pathlib
import re
import subprocess
import sys

import pytest

from accelerate_c.base import settings
from accelerate_c.base.settings import TABLE, SettingError

ROOT = pathlib.Path(__file__).resolve().parent.parent
PKG = ROOT / "accelerate_c"
PREFIX = "ACCELERATE_C" + "_"  # spelled in two pieces so this file names no variable of its own
NAME_RE = re.compile(PREFIX + r"[A-Z0-9_]+")

# Modules that may touch os.environ, and why. Everything else reads through accelerate_c.base.settings.
ENVIRON_ALLOWED = {
    "base/settings.py": "the owner of the variables",
    "launchers.py": "notebook/debug launchers: set up the ranks' environment (RANK, WORLD_SIZE, ...)",
    "commands/": "the launcher and CLI: build the ranks' environment, XDG_CACHE_HOME / HF_HOME paths",
    "base/fsdp_plugin.py": "HF's FullyShardedDataParallelPlugin reads FSDP_* in __post_init__",
    "deepspeed/plugin.py": "HF's DeepSpeedPlugin reads ACCELERATE_DEEPSPEED_* in __post_init__",
    "base/dataclasses.py": "HF's TorchDynamoPlugin reads ACCELERATE_DYNAMO_* in __post_init__",
    "base/environment.py": "HF's patch_environment / clear_environment",
    "tracking/mlops.py": "HF's MLflow / ClearML trackers read MLFLOW_* / CLEARML_*",
}
ENV_ATTRS = {"environ", "environb", "getenv", "putenv", "unsetenv"}
# the launcher writes its internal variables into the ranks' environment by name
VAR_WRITERS = {"commands/launch.py", "commands/config_args.py", "commands/arrivals.py", "commands/config_bounds.py"}


def _modules() -> dict[str, ast.AST]:
    return {str(p.relative_to(PKG)): ast.parse(p.read_text()) for p in sorted(PKG.rglob("*.py"))}


def _allowed(rel: str) -> bool:
    return any(rel == a or (a.endswith("/") and rel.startswith(a)) for a in ENVIRON_ALLOWED)


def _environ_uses(tree: ast.AST) -> list[int]:
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in ENV_ATTRS:
            lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.module in ("os", "posix") and \
                any(a.name in ENV_ATTRS for a in node.names):
            lines.append(node.lineno)
    return lines


def test_environ_only_in_the_allowed_modules():
    mods = _modules()
    bad = [f"accelerate_c/{rel}:{line}" for rel, tree in mods.items() if not _allowed(rel)
           for line in _environ_uses(tree)]
    assert not bad, "os.environ / getenv outside the allowed modules (read through base/settings.py):\n" + \
        "\n".join(bad)
    stale = [a for a in ENVIRON_ALLOWED if not any(rel == a or rel.startswith(a) for rel in mods)]
    assert not stale, f"allowed modules that no longer exist: {stale}"
    assert _environ_uses(mods["base/settings.py"]), "the scan finds nothing, even in settings"


def _name_constants(tree: ast.AST) -> list[tuple[int, str]]:
    """String constants that are (or start) one of our variable names: a key to read or write, not prose."""
    return [(n.lineno, n.value) for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
            and re.fullmatch(PREFIX + r"[A-Z0-9_]*", n.value)]


def test_own_variables_are_named_only_in_settings():
    mods = _modules()
    trees = {f"accelerate_c/{rel}": tree for rel, tree in mods.items() if rel != "base/settings.py"}
    trees["setup.py"] = ast.parse((ROOT / "setup.py").read_text())
    bad = [f"{rel}:{line}: {value!r}" for rel, tree in trees.items() for line, value in _name_constants(tree)]
    assert not bad, "ACCELERATE_C_* names outside base/settings.py (use settings.get):\n" + "\n".join(bad)
    assert _name_constants(mods["base/settings.py"]), "the scan finds nothing, even in settings"
    writers = sorted(rel for rel, tree in mods.items() for n in ast.walk(tree)
                     if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "var"
                     and isinstance(n.func.value, ast.Name) and n.func.value.id == "settings")
    assert set(writers) <= VAR_WRITERS and writers, f"settings.var (a name to write) used in {writers}"


def _mentioned() -> dict[str, set[str]]:
    files = [p for d in ("accelerate_c", "csrc", "docs", "tests") for p in (ROOT / d).rglob("*")
             if p.is_file() and p.suffix in (".py", ".c", ".h", ".inc", ".md")]
    files += [ROOT / "setup.py", ROOT / "README.md"]
    found: dict[str, set[str]] = {}
    for p in files:
        for name in NAME_RE.findall(p.read_text(errors="replace")):
            found.setdefault(name, set()).add(str(p.relative_to(ROOT)))
    return found


def test_every_variable_mentioned_anywhere_is_in_the_table():
    found = _mentioned()
    names = {s.name for s in TABLE}
    unknown = {n: sorted(where) for n, where in found.items() if n not in names}
    assert not unknown, f"variables missing from base/settings.py's TABLE: {unknown}"
    assert len(names) == len(TABLE) and all(s.key == s.name[len(PREFIX):] for s in TABLE)


def test_the_table_is_well_formed():
    for s in TABLE:
        assert s.kind in settings.KINDS and s.scope in settings.SCOPES, s
        assert s.meaning and s.readers, s
        assert bool(s.choices) == (s.kind == "choice"), s
        assert (s.low is None and s.high is None) or s.kind in ("int", "float"), s
        assert s.default is None or s.parse(None) == s.default, s
    internal = {s.key for s in TABLE if s.internal}
    assert internal == {"RUN_ID", "LAUNCHER_PID", "NUM_MACHINES", "CONFIG", "ARRIVAL_DIR"}


def test_configuration_doc_is_the_generated_table():
    doc = (ROOT / "docs" / "configuration.md").read_text()
    assert doc == settings.markdown(), "regenerate: python -m accelerate_c.base.settings --markdown > " \
                                       "docs/configuration.md"
    for s in TABLE:
        assert f"| `{s.name}` |" in doc, s.name
    r = subprocess.run([sys.executable, "-m", "accelerate_c.base.settings", "--markdown"], capture_output=True,
                       text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 0 and r.stdout == doc, r.stderr[-2000:]
    assert "configuration.md" in (ROOT / "docs" / "index.md").read_text()
    assert "configuration.md" in (ROOT / "README.md").read_text()


# ---- the parser -------------------------------------------------------------------------------------------
def _good(s: settings.Setting) -> list[tuple[str, object]]:
    if s.kind == "bool":
        words = [(w, True) for w in settings.TRUE_WORDS] + [(w, False) for w in settings.FALSE_WORDS]
        return words + [(w.upper(), v) for w, v in words] + [(" on ", True), ("Off", False)]
    if s.kind == "choice":
        return [(c, c) for c in s.choices] + [(c.upper(), c) for c in s.choices] + [(f" {s.choices[0]} ", s.choices[0])]
    if s.kind == "int":
        low = int(s.low) if s.low is not None else -5
        vals = [low, low + 1, int(s.high) if s.high is not None else low + 10_000]
        return [(str(v), v) for v in vals] + [(f" {low} ", low)]
    if s.kind == "float":
        vals = [("0", 0.0), ("0.5", 0.5), ("16", 16.0), ("1e3", 1000.0)] + ([(repr(s.low), s.low)] if s.low else [])
        return [(r, v) for r, v in vals if (s.low is None or v >= s.low) and (s.high is None or v <= s.high)]
    return [("box-7", "box-7"), (" spaced ", " spaced ")]


def _bad(s: settings.Setting) -> list[str]:
    if s.kind == "bool":
        return ["2", "maybe", "yes please", "-1"]
    if s.kind == "choice":
        return ["bogus", s.choices[0] + "x", "auto-torch"]
    if s.kind == "int":
        out = ["1.5", "soon", "0x10"]
        out += [str(int(s.low) - 1)] if s.low is not None else []
        out += [str(int(s.high) + 1)] if s.high is not None else []
        return out
    if s.kind == "float":
        return ["-3", "lots", "nan", "inf", "-inf"]
    return []


@pytest.mark.parametrize("key", [s.key for s in TABLE])
def test_each_good_value_round_trips(key):
    s = settings.setting(key)
    for raw, value in _good(s):
        got = settings.get(key, {s.name: raw})
        assert got == value and type(got) is type(value), (raw, got)
    for blank in ("", "  ") if s.kind != "str" else ("",):  # text keeps its spaces
        assert settings.get(key, {s.name: blank}) == s.default
    assert settings.get(key, {}) == s.default


@pytest.mark.parametrize("key", [s.key for s in TABLE if s.kind != "str"])
def test_each_bad_value_is_a_named_error(key):
    s = settings.setting(key)
    for raw in _bad(s):
        with pytest.raises(SettingError, match=re.escape(f"environment variable {s.name}={raw!r}: allowed: ")) as e:
            settings.get(key, {s.name: raw})
        assert isinstance(e.value, ValueError)
        msg = str(e.value)
        for bound in [*s.choices, *(f"{b:_}" for b in (s.low, s.high) if b is not None)]:
            assert str(bound) in msg, (msg, bound)


def test_bounds_in_messages():
    with pytest.raises(SettingError, match=r"ACCELERATE_C_SHM_SPIN_US='-1': allowed: an integer in 0\.\.10_000_000"):
        settings.get("SHM_SPIN_US", {settings.var("SHM_SPIN_US"): "-1"})
    with pytest.raises(SettingError, match=r"ACCELERATE_C_OUTPUT_CACHE_MB='-3': allowed: a finite number in 0\.\.1_048_576"):
        settings.get("OUTPUT_CACHE_MB", {settings.var("OUTPUT_CACHE_MB"): "-3"})
    with pytest.raises(SettingError, match=r"ACCELERATE_C_GRAD_SYNC='fast': allowed: bucketed, reference"):
        settings.get("GRAD_SYNC", {settings.var("GRAD_SYNC"): "fast"})
    with pytest.raises(KeyError, match="NOT_A_KEY"):
        settings.get("NOT_A_KEY")


def test_get_reads_the_environment_now(monkeypatch):
    name = settings.var("SHARD_KERNELS")
    monkeypatch.setenv(name, "0")
    assert settings.get("SHARD_KERNELS") is False
    monkeypatch.setenv(name, "on")
    assert settings.get("SHARD_KERNELS") is True
    monkeypatch.setenv(name, "sometimes")
    with pytest.raises(SettingError, match=f"{name}='sometimes'"):
        settings.get("SHARD_KERNELS")


def test_native_options():
    assert settings.native_options({}) == {"simd": None, "cast_thp": False, "openmp_pool": True, "shm_spin_us": 50,
                                           "shm_inner_spin_us": 1000}
    env = {settings.var("SIMD"): "AVX2", settings.var("CAST_THP"): "1", settings.var("OPENMP_POOL"): "0",
           settings.var("SHM_SPIN_US"): "0", settings.var("SHM_INNER_SPIN_US"): "10000000"}
    assert settings.native_options(env) == {"simd": "avx2", "cast_thp": True, "openmp_pool": False, "shm_spin_us": 0,
                                            "shm_inner_spin_us": 10_000_000}
    for key, raw in (("SIMD", "sse4"), ("CAST_THP", "2"), ("OPENMP_POOL", "pool"), ("SHM_SPIN_US", "10000001"),
                     ("SHM_INNER_SPIN_US", "x")):
        with pytest.raises(SettingError, match=f"{settings.var(key)}={raw!r}"):
            settings.native_options({settings.var(key): raw})


def test_check_covers_run_and_native_variables_only():
    checked = set(settings.check({}))
    assert checked == {s.key for s in TABLE if s.scope in ("run", "native")}
    launcher_only = {s.name: "not-a-number" for s in TABLE if s.scope in ("launcher", "internal", "build")
                     and s.kind in ("int", "bool")}
    assert launcher_only and settings.check(launcher_only)  # not the ranks' to check


# ---- other programs' variables ------------------------------------------------------------------------------
def test_accessors_for_other_programs_variables(monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_CPU", "Yes")
    assert settings.env_flag("ACCELERATE_USE_CPU") is True
    monkeypatch.setenv("ACCELERATE_USE_CPU", "sure")
    with pytest.raises(SettingError, match="ACCELERATE_USE_CPU='sure'"):
        settings.env_flag("ACCELERATE_USE_CPU")
    monkeypatch.delenv("ACCELERATE_USE_CPU")
    assert settings.env_flag("ACCELERATE_USE_CPU") is False and settings.env_flag("ACCELERATE_USE_CPU", None) is None
    monkeypatch.setenv("WORLD_SIZE", "")
    monkeypatch.setenv("PMI_SIZE", "3")
    assert settings.env_int("WORLD_SIZE", "PMI_SIZE", default=1) == 3
    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(SettingError, match="WORLD_SIZE='two'"):
        settings.env_int("WORLD_SIZE", default=1)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    assert settings.env_value("MASTER_PORT", "0") == "0" and not settings.env_is_set("MASTER_PORT")
    for own in (settings.var("COMM"), PREFIX + "ANYTHING"):
        with pytest.raises(ValueError, match="accelerate_c's own"):
            settings.env_value(own)


def test_hf_bool_is_hfs_str_to_bool_with_the_name():
    from accelerate_c.utils import str_to_bool
    for w in settings.TRUE_WORDS + settings.FALSE_WORDS:
        assert settings.hf_bool("FSDP_X", w.upper()) is bool(str_to_bool(w.upper()))
    for bad in ("", " true", "maybe"):
        with pytest.raises(ValueError, match="invalid truth value"):
            str_to_bool(bad)
        with pytest.raises(SettingError, match=f"FSDP_X={bad!r}"):
            settings.hf_bool("FSDP_X", bad)


def test_bootstrap_loads_settings_without_importing_the_package():
    code = ("import sys, runpy\n"
            "ns = runpy.run_path(sys.argv[1])\n"
            "s = ns['_settings']()\n"
            "assert s.get('LAUNCHER_PID', {s.var('LAUNCHER_PID'): '42'}) == 42\n"
            "ours = [m for m in sys.modules if m.split('.')[0] in ('accelerate_c', s.__name__)]\n"
            "assert not ours and s.__name__.startswith('_accelerate_c'), ours\n")
    r = subprocess.run([sys.executable, "-c", code, str(PKG / "commands" / "_bootstrap.py")], capture_output=True,
                       text=True, timeout=60, cwd="/")
    assert r.returncode == 0, r.stderr[-2000:]


# ---- bad values stop the Accelerator ----------------------------------------------------------------------------
@pytest.fixture
def fresh_state():
    from accelerate_c import AcceleratorState, GradientState
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


@pytest.mark.parametrize("key,raw", [("GRAD_SYNC", "bogus"), ("OUTPUT_CACHE_MB", "-3"), ("COMM", "mpi"),
                                     ("SHARD_KERNELS", "maybe"), ("SIMD", "sse"), ("SHM_SPIN_US", "-1"),
                                     ("CAST_THP", "yes please")])
def test_bad_value_stops_accelerator_construction(fresh_state, monkeypatch, key, raw):
    from accelerate_c import Accelerator
    name = settings.var(key)
    monkeypatch.setenv(name, raw)
    with pytest.raises(ValueError, match=re.escape(f"{name}={raw!r}")):
        Accelerator(cpu=True)
    monkeypatch.delenv(name)
    Accelerator(cpu=True)


def test_bad_hf_value_is_named_at_accelerator_construction(fresh_state, monkeypatch):
    from accelerate_c import Accelerator
    monkeypatch.setenv("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "four")
    with pytest.raises(ValueError, match="ACCELERATE_GRADIENT_ACCUMULATION_STEPS='four'"):
        Accelerator(cpu=True)
    monkeypatch.setenv("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "4")
    assert Accelerator(cpu=True).gradient_accumulation_steps == 4
