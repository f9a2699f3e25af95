# tests/test_c_layout.py: the C tree's layout rules (csrc/): one header names CPU targets (simd.h) and every
# kernel dispatches through it, no getenv in C, compute files never reach Python.h, no C file above 600 lines;
# and the run-time options Python passes in (_C.set_options / _C.get_options, read by a shm group when it opens,
# set from the environment by accelerate_c/base/settings.py when _C loads), plus the one bf16 NaN rule that
# differs on purpose (the shm reduction keeps a NaN's sign and payload).
# Not for: the kernels' numerics (test_ops_cast.py, test_optim*.py, test_shm.py).
import glob
import os
import re
import subprocess
import sys

import pytest
import torch
from conftest import ROOT
from simd_levels import LEVELS, simd

from accelerate_c import _C

CSRC = os.path.join(ROOT, "csrc")
SIMD_H = "simd.h"
# Files that include Python.h (through pyhdr.h): the module, its types and the bind_*.c wrappers. Everything
# else under csrc/ is compute code: ops/, optim/, shm/ and the shared core (cpu, parallel, options, ...).
BINDING = {"module.c", "accel_type.c", "bucket_type.c", "tensor.c", "tensor.h", "bind_util.c", "bind_util.h",
           "pyhdr.h"}


def _c_files():
    files = sorted(glob.glob(os.path.join(CSRC, "**", "*.[ch]"), recursive=True) +
                   glob.glob(os.path.join(CSRC, "**", "*.inc"), recursive=True))
    assert len(files) > 30, files  # the glob found the tree
    return {os.path.relpath(f, CSRC): open(f, encoding="utf-8").read() for f in files}


def _is_binding(rel: str) -> bool:
    base = os.path.basename(rel)
    return os.path.dirname(rel) == "" and (base in BINDING or base.startswith("bind_"))


def test_target_attributes_only_in_simd_h():
    files = _c_files()
    outside = [rel for rel, text in files.items() if "__attribute__((target" in text and rel != SIMD_H]
    assert outside == [], f"CPU targets named outside csrc/{SIMD_H}: {outside}"
    targets = re.findall(r'__attribute__\(\(target\("([^"]*)"\)\)\)', files[SIMD_H])
    assert len(targets) == 2 and len(set(targets)) == 2, targets  # one string per vector level (AVX2, AVX-512)
    assert "avx512cd" in targets[1] and "avx2" in targets[0], targets  # the set cpu.c requires per level


def test_kernels_dispatch_through_simd_h():
    """The level is compared with ACC_SIMD_AVX2 / _AVX512 only where it is defined, detected, set or turned into
    a call (ACC_SIMD_CALL); a kernel file that compares it itself dispatches its own way."""
    allowed = {"cpu.h", "cpu.c", SIMD_H, "module.c"}
    files = _c_files()
    own = [rel for rel, text in files.items() if re.search(r"\bACC_SIMD_AVX(2|512)\b", text) and rel not in allowed]
    assert own == [], f"kernels that dispatch without ACC_SIMD_CALL: {own}"
    per_isa = sorted(rel for rel, text in files.items() if rel.endswith(".c") and re.search(
        r'ACC_TARGET_AVX|ACC_SIMD_INSTANCES\(|#include "isa_instances.inc"', text))
    assert per_isa == ["ops/cast.c", "ops/gradops.c", "optim/adam.c", "optim/adam_lowbit.c", "optim/optim_util.c",
                       "optim/qmap.c", "optim/sgd.c", "shm/shm_reduce.c"], per_isa
    for rel in per_isa:
        assert "ACC_SIMD_CALL(" in files[rel], f"{rel} has per-ISA code but no ACC_SIMD_CALL"
        assert '#include "simd.h"' in files[rel], rel


def test_no_getenv_in_c():
    hits = [rel for rel, text in _c_files().items() if re.search(r"\b(secure_)?getenv\b|\benviron\b", text)]
    assert hits == [], f"C reads the environment in {hits}: pass the value from Python (_C.set_options)"


def _includes(rel: str, text: str, files) -> list:
    """The quoted includes of a csrc file resolved to csrc-relative paths (its own directory first, then csrc/),
    plus the system headers it names."""
    out = []
    for name in re.findall(r'^\s*#\s*include\s*[<"]([^">]+)[">]', text, re.M):
        for cand in (os.path.normpath(os.path.join(os.path.dirname(rel), name)), name):
            if cand in files:
                out.append(cand)
                break
        else:
            out.append("<" + name + ">")
    return out


def test_compute_files_never_reach_python_h():
    files = _c_files()
    graph = {rel: _includes(rel, text, files) for rel, text in files.items()}

    def reaches_python(rel, seen):
        for inc in graph.get(rel, []):
            if inc in ("<Python.h>", "<structmember.h>"):
                return True
            if inc in files and inc not in seen:
                seen.add(inc)
                if reaches_python(inc, seen):
                    return True
        return False

    compute = [rel for rel in files if not _is_binding(rel)]
    assert {"ops/cast.c", "optim/adam.c", "shm/shm_reduce.c", "options.c", "cpu.c"} <= set(compute)
    bad = [rel for rel in compute if reaches_python(rel, set())]
    assert bad == [], f"compute files that include Python.h (directly or through a header): {bad}"
    assert reaches_python("bind_optim.c", set())  # the check sees through pyhdr.h


def test_c_files_at_most_600_lines():
    long = {rel: text.count("\n") for rel, text in _c_files().items() if text.count("\n") > 600}
    assert long == {}, f"C files over 600 lines: {long}"


# ---- run-time options ------------------------------------------------------------------------------------

@pytest.fixture
def restore_options():
    old = _C.get_options()
    yield old
    _C.set_options(**old)


def test_options_round_trip(restore_options):
    assert set(restore_options) == {"cast_thp", "openmp_pool", "shm_spin_us", "shm_inner_spin_us"}
    _C.set_options(cast_thp=True, openmp_pool=False, shm_spin_us=0, shm_inner_spin_us=10_000_000)
    assert _C.get_options() == {"cast_thp": True, "openmp_pool": False, "shm_spin_us": 0,
                                "shm_inner_spin_us": 10_000_000}
    _C.set_options(shm_spin_us=123)  # options not given keep their value
    assert _C.get_options() == {"cast_thp": True, "openmp_pool": False, "shm_spin_us": 123,
                                "shm_inner_spin_us": 10_000_000}
    _C.set_options(cast_thp=False, openmp_pool=True)
    assert _C.get_options()["cast_thp"] is False
    _C.set_options()
    assert _C.get_options() == {"cast_thp": False, "openmp_pool": True, "shm_spin_us": 123,
                                "shm_inner_spin_us": 10_000_000}


@pytest.mark.parametrize("kwargs, exc, match", [
    ({"cast_thp": 1}, TypeError, "cast_thp must be a bool"),
    ({"cast_thp": "1"}, TypeError, "cast_thp must be a bool"),
    ({"openmp_pool": 0}, TypeError, "openmp_pool must be a bool"),
    ({"shm_spin_us": "50"}, TypeError, "shm_spin_us must be an int"),
    ({"shm_spin_us": 5.0}, TypeError, "shm_spin_us must be an int"),
    ({"shm_spin_us": True}, TypeError, "shm_spin_us must be an int"),
    ({"shm_spin_us": -1}, ValueError, "shm_spin_us must be between 0 and 10000000"),
    ({"shm_spin_us": 10_000_001}, ValueError, "shm_spin_us must be between 0 and 10000000"),
    ({"shm_spin_us": 2 ** 80}, ValueError, "shm_spin_us must be between 0 and 10000000"),
    ({"shm_inner_spin_us": -5}, ValueError, "shm_inner_spin_us must be between 0 and 10000000"),
    ({"shm_inner_spin_us": None}, TypeError, "shm_inner_spin_us must be an int"),
    ({"spin_us": 5}, TypeError, "unknown option 'spin_us'"),
    ({"shm_spin_us": 7, "shm_inner_spin_us": -1}, ValueError, "shm_inner_spin_us"),  # nothing applied
])
def test_options_bad_values_raise_and_change_nothing(restore_options, kwargs, exc, match):
    before = _C.get_options()
    with pytest.raises(exc, match=match):
        _C.set_options(**kwargs)
    assert _C.get_options() == before


def test_options_keyword_only():
    with pytest.raises(TypeError, match="keyword arguments only"):
        _C.set_options(True)


def test_shm_group_takes_the_spin_values_current_when_it_opens(restore_options):
    name = f"/accc-layout-{os.getpid()}"
    _C.set_options(shm_spin_us=321, shm_inner_spin_us=654)
    h = _C.shm_group_open(name, True, 0, 1, 0, 0, 5.0)
    try:
        assert _C.shm_group_spin_us(h) == (321, 654)
        _C.set_options(shm_spin_us=1, shm_inner_spin_us=2)  # an open group keeps its values
        assert _C.shm_group_spin_us(h) == (321, 654)
        h2 = _C.shm_group_open(name + "-b", True, 0, 1, 0, 0, 5.0)
        try:
            assert _C.shm_group_spin_us(h2) == (1, 2)
        finally:
            _C.shm_group_close(h2)
            _C.shm_unlink(name + "-b")
    finally:
        _C.shm_group_close(h)
        _C.shm_unlink(name)


def _fresh_options(env_update: dict) -> str:
    env = {k: v for k, v in os.environ.items()
           if k not in ("ACCELERATE_C_SIMD", "ACCELERATE_C_CAST_THP", "ACCELERATE_C_OPENMP_POOL",
                        "ACCELERATE_C_SHM_SPIN_US", "ACCELERATE_C_SHM_INNER_SPIN_US")}
    env.update(env_update, PYTHONPATH=ROOT)
    code = "from accelerate_c import _C; print(_C.get_options(), _C.simd_level())"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True,
                          timeout=120).stdout.strip()


def test_options_defaults_and_environment_at_load():
    """The values the C code used to read with getenv, validated by accelerate_c.base.settings and passed in
    once, when _C loads; SIMD only lowers."""
    best = _C.simd_detected()
    default = "{'cast_thp': False, 'openmp_pool': True, 'shm_spin_us': 50, 'shm_inner_spin_us': 1000}"
    assert _fresh_options({}) == f"{default} {best}"
    got = _fresh_options({"ACCELERATE_C_SIMD": "scalar", "ACCELERATE_C_CAST_THP": "1", "ACCELERATE_C_OPENMP_POOL": "0",
                          "ACCELERATE_C_SHM_SPIN_US": " 77", "ACCELERATE_C_SHM_INNER_SPIN_US": "0"})
    assert got == "{'cast_thp': True, 'openmp_pool': False, 'shm_spin_us': 77, 'shm_inner_spin_us': 0} scalar"
    got = _fresh_options({"ACCELERATE_C_SIMD": "avx512", "ACCELERATE_C_CAST_THP": "0"})
    assert got == f"{default} {best}"
    if best != "scalar":
        assert _fresh_options({"ACCELERATE_C_SIMD": "avx2"}).endswith(" avx2")


@pytest.mark.parametrize("var,value", [("ACCELERATE_C_SIMD", "sse"), ("ACCELERATE_C_CAST_THP", "1yes"),
                                       ("ACCELERATE_C_OPENMP_POOL", "omp"),
                                       ("ACCELERATE_C_SHM_SPIN_US", "many"), ("ACCELERATE_C_SHM_INNER_SPIN_US", "-4")])
def test_bad_native_option_is_a_named_error_at_load(var, value):
    """The C code ignored these (or read them as atol does); they are now errors naming the variable."""
    with pytest.raises(subprocess.CalledProcessError) as info:
        _fresh_options({var: value})
    assert var in info.value.stderr and repr(value) in info.value.stderr, info.value.stderr


# ---- the bf16 NaN rule of the shm reduction ------------------------------------------------------------

def _bits(vals, dtype):
    return torch.tensor([v - 65536 if v >= 32768 else v for v in vals], dtype=torch.int16).view(dtype).clone()


@pytest.mark.parametrize("level", LEVELS)
def test_shm_reduction_keeps_nan_sign_and_payload(level):
    """fpconv.h's acc_f32_to_bf16_quiet: a bf16 NaN comes back with its sign and payload, quiet bit set (the
    casts write 0xFFFF, the optimizers 0x7FC0); fp16 NaNs as F16C converts them."""
    name = f"/accc-layout-nan-{os.getpid()}"
    h = _C.shm_group_open(name, True, 0, 1, 0, 0, 5.0)
    try:
        _C.shm_group_wait_attached(h)
        with simd(level):
            for op in (0, 1):  # sum, avg
                t = _bits([0xFFC1, 0x7F81, 0x7FC0, 0x3F80, 0xFFFF, 0x7FA5] * 20, torch.bfloat16)
                _C.shm_all_reduce(h, t, op)
                got = [x & 0xFFFF for x in t.view(torch.int16)[:6].tolist()]
                assert got == [0xFFC1, 0x7FC1, 0x7FC0, 0x3F80, 0xFFFF, 0x7FE5], [hex(x) for x in got]
                t = _bits([0xFE01, 0x7C01, 0x7E00, 0x3C00, 0xFFFF] * 20, torch.float16)
                _C.shm_all_reduce(h, t, op)
                got = [x & 0xFFFF for x in t.view(torch.int16)[:5].tolist()]
                assert got == [0xFE01, 0x7E01, 0x7E00, 0x3C00, 0xFFFF], [hex(x) for x in got]
    finally:
        _C.shm_group_close(h)
        _C.shm_unlink(name)
