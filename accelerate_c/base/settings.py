# accelerate_c/base/settings.py: the one owner of accelerate_c's environment variables. TABLE lists every
# ACCELERATE_C_* variable (type, default, bounds or choices, meaning, who reads it) and one parser turns a raw
# value into a typed one or a SettingError (a ValueError) naming the variable, the value and what is allowed.
# Every read of an ACCELERATE_C_* variable goes through `get` (or `check` / `native_options`); the variables of
# other programs (HF's ACCELERATE_*, torch's, MPI's) that our runtime reads go through the env_* accessors, so
# that os.environ is read here, in the launcher and in HF's own faces (tests/test_settings.py holds that).
# docs/configuration.md is generated from TABLE: `python -m accelerate_c.base.settings --markdown`.
# Not for: HF's plugin/dataclass variables (FSDP_*, ACCELERATE_DEEPSPEED_*, ...), read where HF reads them.
# Imports nothing of accelerate_c (the launcher's bootstrap and setup.py load this file by path).
from __future__ import annotations

import math
import os
import sys
import textwrap
from dataclasses import dataclass
from typing import Any, Mapping, Optional

PREFIX = "ACCELERATE_C_"
# one truth table for every boolean variable (HF's str_to_bool accepts the same words)
TRUE_WORDS = ("1", "true", "yes", "on", "y", "t")
FALSE_WORDS = ("0", "false", "no", "off", "n", "f")
KINDS = ("bool", "int", "float", "choice", "str")
# who reads a variable: the training processes, the C extension (through native_options), the launcher / CLI,
# the ranks only as written by the launcher (never set by hand), the build (setup.py), tests' hooks
SCOPES = ("run", "native", "launcher", "internal", "build", "test")
SPIN_MAX_US = 10_000_000


class SettingError(ValueError):
    """A variable's value is not allowed; the message names the variable, the value and what is allowed."""


def _fail(name: str, raw: str, allowed: str) -> SettingError:
    return SettingError(f"environment variable {name}={raw!r}: allowed: {allowed}")


def _blank(raw: Optional[str]) -> bool:
    return raw is None or not raw.strip()


def _bounds(low: Optional[float], high: Optional[float], what: str) -> str:
    if low is not None and high is not None:
        return f"{what} in {low:_}..{high:_}"
    if low is not None:
        return f"{what} >= {low:_}"
    if high is not None:
        return f"{what} <= {high:_}"
    return what


def parse_bool(name: str, raw: Optional[str], default: Any = None) -> Any:
    """1/0, true/false, yes/no, on/off, y/n, t/f (any case, spaces around ignored); unset or blank: `default`."""
    if _blank(raw):
        return default
    v = raw.strip().lower()
    if v in TRUE_WORDS:
        return True
    if v in FALSE_WORDS:
        return False
    raise _fail(name, raw, "1 or 0 (true/false, yes/no, on/off)")


def hf_bool(name: str, raw: str) -> bool:
    """HF's reading of one of its own boolean variables (str_to_bool: the same words, any case; no blank-as-unset,
    no stripping), for the faces that read HF's variables where HF does; the error names the variable."""
    v = str(raw).lower()
    if v in TRUE_WORDS:
        return True
    if v in FALSE_WORDS:
        return False
    raise _fail(name, raw, "1 or 0 (true/false, yes/no, on/off)")


def parse_int(name: str, raw: Optional[str], default: Any = None, low: Optional[int] = None,
              high: Optional[int] = None) -> Any:
    """A whole number within [low, high] (either may be None: unbounded); unset or blank: `default`."""
    if _blank(raw):
        return default
    allowed = _bounds(low, high, "an integer")
    try:
        v = int(raw.strip())
    except ValueError:
        raise _fail(name, raw, allowed) from None
    if (low is not None and v < low) or (high is not None and v > high):
        raise _fail(name, raw, allowed)
    return v


def parse_float(name: str, raw: Optional[str], default: Any = None, low: Optional[float] = None,
                high: Optional[float] = None) -> Any:
    """A finite number within [low, high] (either may be None: unbounded); unset or blank: `default`."""
    if _blank(raw):
        return default
    allowed = _bounds(low, high, "a finite number")
    try:
        v = float(raw.strip())
    except ValueError:
        raise _fail(name, raw, allowed) from None
    if not math.isfinite(v) or (low is not None and v < low) or (high is not None and v > high):
        raise _fail(name, raw, allowed)
    return v


def parse_choice(name: str, raw: Optional[str], default: Any, choices: tuple[str, ...]) -> Any:
    """One of `choices` (any case, spaces around ignored), returned lower-case; unset or blank: `default`."""
    if _blank(raw):
        return default
    v = raw.strip().lower()
    if v not in choices:
        raise _fail(name, raw, ", ".join(choices))
    return v


def parse_str(name: str, raw: Optional[str], default: Any = None) -> Any:
    """The value as given; unset or empty: `default`."""
    return default if not raw else raw


@dataclass(frozen=True)
class Setting:
    key: str                      # the variable's name without ACCELERATE_C_
    kind: str                     # one of KINDS
    default: Any                  # the value when unset or blank (None: the reader decides, see `meaning`)
    meaning: str
    readers: str                  # the modules that read it
    scope: str = "run"            # one of SCOPES
    low: Optional[float] = None   # int / float bounds, inclusive
    high: Optional[float] = None
    choices: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return PREFIX + self.key

    @property
    def internal(self) -> bool:
        return self.scope == "internal"

    def parse(self, raw: Optional[str]) -> Any:
        if self.kind == "bool":
            return parse_bool(self.name, raw, self.default)
        if self.kind == "int":
            return parse_int(self.name, raw, self.default, self.low, self.high)
        if self.kind == "float":
            return parse_float(self.name, raw, self.default, self.low, self.high)
        if self.kind == "choice":
            return parse_choice(self.name, raw, self.default, self.choices)
        return parse_str(self.name, raw, self.default)

    def allowed(self) -> str:
        """What the variable accepts, in words (the docs' column)."""
        if self.kind == "bool":
            return "1/0, true/false, yes/no, on/off"
        if self.kind == "choice":
            return " \\| ".join(self.choices)
        if self.kind == "int":
            return _bounds(self.low, self.high, "integer")
        if self.kind == "float":
            return _bounds(self.low, self.high, "number")
        return "any text"


_S = Setting
TABLE: tuple[Setting, ...] = (
    # ---- read in the training processes ---------------------------------------------------------------------
    _S("COMM", "choice", "auto", "transport of CPU collectives: auto = shared memory inside a host (hierarchical "
       "across hosts), torch = torch.distributed everywhere", "ddp/config.py (DDPConfig.transport), "
       "comm/group.py (get_group)", choices=("auto", "torch")),
    _S("GRAD_SYNC", "choice", "bucketed", "data-parallel gradient sync: bucketed (overlapped with backward, "
       "ddp/bucketed.py) or reference (one coalesced all-reduce at the end of backward, strategies/ddp.py)",
       "ddp/config.py (DDPConfig.grad_sync)", choices=("bucketed", "reference")),
    _S("SHARDED_STEP", "bool", True, "split the optimizer step between the ranks of a host (0: every rank steps "
       "every parameter)", "ddp/config.py (DDPConfig.sharded_step)"),
    _S("FUSED_OPTIMIZER", "bool", True, "run prepared torch optimizers on the fused C kernels (0 also turns the "
       "split step off)", "ddp/config.py (StrategyConfig.fused_optimizer)"),
    _S("SHARD_KERNELS", "bool", True, "the sharded engine's C copy-in and fused compute-copy write (0: torch "
       "copies and a separate cast after the step)", "sharding/pack.py (kernels_enabled, at every call)"),
    _S("CUDA_KERNELS", "bool", True, "CUDA tensors take accelerate_c._C_cuda's kernels (fused optimizers, casts, "
       "gradient passes, the sharded engine's copies) where the extension was built and torch sees a GPU (0: "
       "torch's own kernels, the baseline of benchmarks/gpu_check.py)", "optim/cuda.py (kernels, at its first call)"),
    _S("SHARD_STAGING_MB", "float", 8.0, "MiB of each of the sharded engine's two gradient staging windows (a "
       "unit larger than one is reduce-scattered in pieces)", "sharding/config.py (ShardedConfig.staging_mb)",
       low=1 / 1024, high=1 << 20),
    _S("OUTPUT_CACHE_MB", "float", 256.0, "MiB of free blocks kept for the large CPU tensors collectives return "
       "(0 turns the cache off)", "comm/outbuf.py (limit_bytes, read once)", low=0, high=1 << 20),
    _S("LARGE_TENSOR_PAGES", "choice", "auto", "CPU runs: torch tensors of 2 MiB and more in mappings of their "
       "own with transparent huge pages (torch's THP_MEM_ALLOC_ENABLE) and glibc's mmap threshold fixed at 4 MiB, so "
       "a step's freed temporaries go back to the system at once instead of staying in (and fragmenting) the C "
       "heap; left off (logged) where torch made such a tensor before Accelerator() or the system has no huge "
       "pages. auto = where the strategy gathers and frees whole units every step (ZeRO-3, FSDP FULL_SHARD); on = "
       "every CPU run; off = torch's and glibc's defaults", "runtime/memory.py (tune_cpu_heap, at Accelerator())",
       choices=("auto", "on", "off")),
    _S("CPU_BF16_MATMUL", "choice", "fast", "bf16 autocast on a CPU without native bf16 matmuls (no AVX512-BF16 "
       "or AMX), where torch's bf16 matmuls and convolutions run tens of times slower than fp32 and its attention "
       "backward several times: fast = inputs rounded to bf16, the op in fp32, the output rounded to bf16 (torch's "
       "rounding points; bf16 tensors saved for backward); torch = torch's own kernels (with a one-time "
       "RuntimeWarning)",
       "precision/cpu_bf16.py (install, at the first BF16Precision)", choices=("fast", "torch")),
    _S("AS_ACCELERATE", "bool", False, "every `import accelerate` (the package and its submodules) resolves to "
       "accelerate_c, for code that imports HF Accelerate itself (transformers' Trainer, PEFT, TRL); read at "
       "interpreter start-up by the accelerate_c_as_accelerate.pth file the package installs, and by the "
       "launcher's ranks (`launch --as_accelerate` sets it)", "as_accelerate.py (install_from_env), "
       "commands/_bootstrap.py"),
    _S("HOST_ID", "str", None, "this process's host identity: ranks with the same id share memory; unset: the "
       "hostname. The launcher sets one per launch and machine (`--host_id`)", "comm/group.py (host_id)"),
    # ---- read by the C extension, through native_options() ----------------------------------------------------
    _S("SIMD", "choice", None, "lower the SIMD level of the C kernels (never above what the CPU has); unset: "
       "the CPU's best", "the C extension (native_options: _C.simd_level)", "native",
       choices=("scalar", "avx2", "avx512")),
    _S("CAST_THP", "bool", False, "ask for transparent huge pages (madvise) for large cast outputs",
       "the C extension (native_options: _C.set_options)", "native"),
    _S("OPENMP_POOL", "bool", True, "run the multi-threaded C kernels (optimizer steps, casts, packs) called from "
       "the main thread on the OpenMP thread pool torch loaded, instead of threads created per call (which share the "
       "cores with the pool's threads while those spin after a torch op)",
       "the C extension (native_options: _C.set_options)", "native"),
    _S("SHM_SPIN_US", "int", 50, "microseconds a shared-memory wait spins before it sleeps",
       "the C extension (native_options: _C.set_options)", "native", low=0, high=SPIN_MAX_US),
    _S("SHM_INNER_SPIN_US", "int", 1000, "microseconds a wait spins between the phases of one collective (the "
       "peer is known to be mid-call)", "the C extension (native_options: _C.set_options)", "native",
       low=0, high=SPIN_MAX_US),
    # ---- read by the launcher / CLI -----------------------------------------------------------------------------
    _S("RDZV_TIMEOUT", "int", None, "seconds the machines of a multi-machine launch wait for each other at the "
       "rendezvous; unset: torch's default (900 for c10d, 600 for static)", "commands/launch.py (_rdzv_timeout)",
       "launcher", low=1, high=7 * 24 * 3600),
    _S("CONFIG_DIR", "str", None, "where `config` writes and `launch` first looks for default_config.yaml; "
       "unset: $XDG_CACHE_HOME/accelerate_c (~/.cache/accelerate_c)", "commands/config_args.py (config_dir)",
       "launcher"),
    # ---- written by the launcher into every rank's environment ----------------------------------------------------
    _S("CONFIG", "str", None, "the launcher's resolved config (file + flags) as JSON",
       "commands/config_args.py (config_from_env)", "internal"),
    _S("RUN_ID", "str", None, "the launch's run id (the prefix of the rendezvous store's keys)",
       "no module (for the ranks' scripts and tests)", "internal"),
    _S("NUM_MACHINES", "int", None, "how many machines the launch spans", "no module (for the ranks' scripts and "
       "tests)", "internal", low=1),
    _S("LAUNCHER_PID", "int", None, "the launcher's pid: a rank gets SIGTERM when the launcher dies",
       "commands/_bootstrap.py (_die_with_launcher)", "internal", low=1),
    _S("ARRIVAL_DIR", "str", None, "the folder where each rank notes its start and its call of init_process_group, "
       "for the launcher's report of ranks that have not arrived (`--startup_report_interval`)",
       "commands/_bootstrap.py (_note_arrivals), commands/arrivals.py", "internal"),
    # ---- read by the build ----------------------------------------------------------------------------------------
    _S("DEBUG", "bool", False, "build the C extension with -O0 -g", "setup.py", "build"),
    _S("SANITIZE", "bool", False, "build the C extension with ASan/UBSan", "setup.py", "build"),
    _S("CUDA_BUILD", "bool", True, "build the CUDA extension accelerate_c._C_cuda where nvcc is found (0: never, "
       "the CPU-only build even on a machine with the CUDA toolkit)", "setup.py (csrc/cuda/build.py)", "build"),
    # ---- test hooks ---------------------------------------------------------------------------------------------
    _S("KILL_AT", "str", None, "`<point>[@<rank>][:launcher]`: the process reaching the named point of start-up or "
       "save (and of that RANK) SIGKILLs itself (or the launcher); the points: base/killpoints.py",
       "base/killpoints.py (kill_point, at every point)", "test"),
)
BY_KEY = {s.key: s for s in TABLE}


def setting(key: str) -> Setting:
    """The table's entry for `key` (the name without ACCELERATE_C_); a KeyError names an unknown key."""
    try:
        return BY_KEY[key]
    except KeyError:
        raise KeyError(f"{PREFIX}{key} is not in accelerate_c.base.settings.TABLE") from None


def var(key: str) -> str:
    """The variable's full name (for writers: the launcher puts the internal ones into the ranks' env)."""
    return setting(key).name


def get(key: str, env: Optional[Mapping[str, str]] = None) -> Any:
    """The typed value of ACCELERATE_C_<key> in `env` (default os.environ), read now; unset or blank: the
    table's default; a value that is not allowed: SettingError naming the variable, the value and the bounds."""
    s = setting(key)
    return s.parse((os.environ if env is None else env).get(s.name))


def unknown_names(env: Optional[Mapping[str, str]] = None) -> list[str]:
    """The ACCELERATE_C_* names in `env` (default os.environ) that are not in TABLE (a typo, or a variable of
    another version), sorted; the launcher warns about them."""
    env = os.environ if env is None else env
    return sorted(k for k in env if k.startswith(PREFIX) and k[len(PREFIX):] not in BY_KEY)


def check(env: Optional[Mapping[str, str]] = None, scopes: tuple[str, ...] = ("run", "native")) -> dict[str, Any]:
    """Every variable of `scopes` parsed (SettingError at the first bad one): {key: value}. The strategies'
    config calls it, so a bad value stops the run when the Accelerator is built, not at first use."""
    env = os.environ if env is None else env
    return {s.key: s.parse(env.get(s.name)) for s in TABLE if s.scope in scopes}


def native_options(env: Optional[Mapping[str, str]] = None) -> dict[str, Any]:
    """The C extension's options, validated: simd (None: the CPU's best; else a level to lower to, for
    _C.simd_level) and cast_thp, openmp_pool, shm_spin_us, shm_inner_spin_us (for _C.set_options)."""
    return {"simd": get("SIMD", env), "cast_thp": get("CAST_THP", env), "openmp_pool": get("OPENMP_POOL", env),
            "shm_spin_us": get("SHM_SPIN_US", env), "shm_inner_spin_us": get("SHM_INNER_SPIN_US", env)}


def apply_native_options(C: Any) -> None:
    """Hands native_options() to the C extension `C`; the extension calls this once as it loads (csrc/module.c),
    the one place every first import of accelerate_c._C passes. SIMD only lowers: a level above what the CPU has
    leaves the CPU's best. A bad value is a SettingError naming the variable, raised by that first import."""
    opts = native_options()
    simd = opts.pop("simd")
    order = ("scalar", "avx2", "avx512")
    if simd is not None and order.index(simd) < order.index(C.simd_detected()):
        C.simd_level(simd)
    C.set_options(**opts)


# ---- other programs' variables (HF's ACCELERATE_*, torch's, MPI's) that the runtime reads or sets -----------------
def _foreign(name: str) -> str:
    if name.startswith(PREFIX):
        raise ValueError(f"{name} is accelerate_c's own: read it with settings.get({name[len(PREFIX):]!r})")
    return name


def env_value(name: str, default: Optional[str] = None) -> Optional[str]:
    """The raw value of a variable that is not ours, or `default` when unset (os.environ.get)."""
    return os.environ.get(_foreign(name), default)


def env_flag(name: str, default: Any = False) -> Any:
    """A boolean variable that is not ours (the truth table above); unset or blank: `default`."""
    return parse_bool(name, os.environ.get(_foreign(name)), default)


def env_int(*names: str, default: Any = None) -> Any:
    """The first of `names` that is set and not empty, as an integer (SettingError naming it otherwise);
    none set: `default`."""
    for name in names:
        raw = os.environ.get(_foreign(name))
        if raw not in (None, ""):
            try:
                return int(raw)
            except ValueError:
                raise _fail(name, raw, "an integer") from None
    return default


def env_is_set(name: str) -> bool:
    return _foreign(name) in os.environ


def env_set(name: str, value: str) -> None:
    """Sets a variable that is not ours (HF's state does: ACCELERATE_USE_DEEPSPEED, ...)."""
    os.environ[_foreign(name)] = value


def env_setdefault(name: str, value: str) -> str:
    return os.environ.setdefault(_foreign(name), value)


# ---- docs/configuration.md -------------------------------------------------------------------------------------
_SCOPE_TITLES = {
    "run": "Read in the training processes",
    "native": "Read by the C extension (validated in Python: `native_options()`)",
    "launcher": "Read by the launcher and the CLI",
    "internal": "Internal: written by the launcher into every rank's environment (never set them by hand)",
    "build": "Read when building the C extension (`setup.py`)",
    "test": "Test hooks (never set them outside tests)",
}


def _default_text(s: Setting) -> str:
    if s.default is None:
        return "unset"
    if s.kind == "bool":
        return "1" if s.default else "0"
    if s.kind == "float" and float(s.default).is_integer():
        return str(int(s.default))
    return str(s.default)


def markdown() -> str:
    """docs/configuration.md, from TABLE (tests/test_settings.py checks the file equals this)."""
    out = ["# Configuration: accelerate_c's environment variables", "",
           "<!-- generated by `python -m accelerate_c.base.settings --markdown > docs/configuration.md`;",
           "     edit the table in accelerate_c/base/settings.py -->", ""]
    out += textwrap.wrap(
           "Every `ACCELERATE_C_*` variable, from the one table in `accelerate_c/base/settings.py`, which also "
           "parses them. Unset or empty means the default. Booleans take `1`/`0`, `true`/`false`, `yes`/`no`, "
           "`on`/`off`, `y`/`n`, `t`/`f` (any case); choices any case. Any other value stops the run with a "
           "`ValueError` naming the variable, the value and what is allowed; the variables read in the "
           "training processes and by the C extension are all checked when the `Accelerator` is built.", 110)
    out += [""] + textwrap.wrap(
           "HF Accelerate's own variables (`ACCELERATE_MIXED_PRECISION`, `FSDP_*`, `ACCELERATE_DEEPSPEED_*`, "
           "...) mean what they mean in HF; see [launching.md](launching.md) for the ones the launcher sets.", 110)
    for scope in SCOPES:
        rows = [s for s in TABLE if s.scope == scope]
        out += ["", f"## {_SCOPE_TITLES[scope]}", "", "| variable | type | default | allowed | meaning | read by |",
                "|---|---|---|---|---|---|"]
        out += [f"| `{s.name}` | {s.kind} | {_default_text(s)} | {s.allowed()} | {s.meaning} | {s.readers} |"
                for s in rows]
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    if sys.argv[1:] != ["--markdown"]:
        sys.exit("usage: python -m accelerate_c.base.settings --markdown")
    sys.stdout.write(markdown())
