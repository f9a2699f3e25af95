# tests/test_cuda_ext.py: the CUDA extension accelerate_c._C_cuda without a GPU. Its kernels' launch plans and
# per-thread code are ACC_HD functions that the module also runs on the CPU (the emulate_* twins, csrc/cuda/kernels.h):
# each is compared here, bit for bit, with the CPU kernel it mirrors (_C), which the other tests compare with torch.
# Also: the build switch (ACCELERATE_C_CUDA_BUILD=0 leaves _C_cuda out of setup.py's extensions), the build product
# being current where nvcc is found, the package working with the extension absent, the real entry points refusing
# CPU tensors and failing cleanly (an exception, never a crash) with no GPU behind a CUDA tensor.
# Not for: the kernels on a GPU (benchmarks/gpu_check.py) or device selection (tests/test_device.py).
from __future__ import annotations

import glob
import importlib.util
import os
import re
import subprocess
import sys

import pytest
import torch

from accelerate_c import _C
from accelerate_c.optim import cuda as cuda_dispatch
from accelerate_c.optim import lowbit

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

try:
    from accelerate_c import _C_cuda as CU
except ImportError:  # built only where nvcc was found (setup.py)
    CU = None

needs_ext = pytest.mark.skipif(CU is None, reason="accelerate_c._C_cuda was not built (no nvcc at install)")


def _build_module():
    spec = importlib.util.spec_from_file_location("_cuda_build_for_tests", os.path.join(ROOT, "csrc", "cuda",
                                                                                        "build.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _same(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape, what
    diff = (_bits(a) != _bits(b)).nonzero()
    assert diff.numel() == 0, f"{what}: {diff.shape[0]} elements differ, first at {diff[0].tolist()}"


# ---- the build -----------------------------------------------------------------------------------------------------

def _extensions(env_value: str) -> list[str]:
    code = ("import runpy, setuptools\n"
            "setuptools.setup = lambda **kw: print(','.join(sorted(e.name for e in kw['ext_modules'])))\n"
            "runpy.run_path('setup.py', run_name='__main__')\n")
    env = dict(os.environ, ACCELERATE_C_CUDA_BUILD=env_value)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().splitlines()[-1].split(",")


def test_setup_builds_cuda_only_when_asked_and_nvcc_found():
    assert _extensions("0") == ["accelerate_c._C"]
    want = ["accelerate_c._C", "accelerate_c._C_cuda"] if _build_module().find_nvcc() else ["accelerate_c._C"]
    assert _extensions("1") == want


def test_build_product_current_where_nvcc_found():
    build = _build_module()
    if not build.find_nvcc():
        pytest.skip("no nvcc here: the CPU-only build")
    found = glob.glob(os.path.join(ROOT, "accelerate_c", "_C_cuda*.so"))
    assert found, "nvcc is here but accelerate_c/_C_cuda*.so is missing: run `make install`"
    srcs = build.depends() + [os.path.join(build.CSRC, s) for s in build.C_SOURCES]
    stale = [s for s in srcs if os.path.getmtime(s) > os.path.getmtime(found[0])]
    assert not stale, f"{found[0]} is older than {stale}: run `make install`"
    assert CU is not None
    info = CU.info()
    assert info["chunk"] == CU.CHUNK and info["qblock"] == 256 and info["devices"] >= 0


def test_package_works_without_the_extension(tmp_path):
    """_C_cuda made unimportable: the package imports, a fused CPU step runs, the dispatch says why not."""
    code = ("import sys, torch\n"
            "sys.modules['accelerate_c._C_cuda'] = None\n"
            "from accelerate_c.optim import cuda, fused_step\n"
            "torch.cuda.is_available = lambda: True\n"
            "assert cuda.kernels() is None, 'kernels without the module'\n"
            "print(cuda.why_not())\n"
            "p = torch.nn.Parameter(torch.ones(10)); p.grad = torch.full((10,), 0.5)\n"
            "opt = torch.optim.AdamW([p], lr=0.1)\n"
            "assert fused_step(opt) is True\n"
            "print(float(p[0]))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert "was not built" in lines[0]
    assert float(lines[1]) < 1.0


def test_dispatch_off_without_gpu(monkeypatch):
    monkeypatch.setattr(cuda_dispatch, "_LOADED", False)
    monkeypatch.setattr(cuda_dispatch, "_MOD", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cuda_dispatch.kernels() is None and cuda_dispatch.why_not() == "torch sees no CUDA device"
    monkeypatch.setenv("ACCELERATE_C_CUDA_KERNELS", "0")
    assert cuda_dispatch.why_not() == "ACCELERATE_C_CUDA_KERNELS=0"


# ---- the real entry points without a GPU ------------------------------------------------------------------------

@needs_ext
def test_real_entry_points_refuse_cpu_tensors():
    x = torch.ones(8)
    cases = [
        ("cast: src", lambda: CU.cast(x, torch.empty(8, dtype=torch.bfloat16), None, None, None)),
        ("params[0]", lambda: CU.adam_step([x], [x], [x], [x], None, 1.0, None, 1e-3, 0.9, 0.999, 1e-8, 0.0, True,
                                           False, False, 1.0, None, False)),
        ("params[0]", lambda: CU.sgd_step([x], [x], None, None, None, 0.1, 0.0, 0.0, 0.0, False, False, 1.0, None)),
        ("tensors[0]", lambda: CU.multi_scale_([x], 2.0, None, None)),
        ("srcs[0]", lambda: CU.multi_copy([x], [x.clone()], None)),
    ]
    for name, call in cases:
        with pytest.raises(ValueError, match=r"cpu|CPU|device") as e:
            call()
        assert name.split("[")[0].split(":")[0] in str(e.value), (name, str(e.value))


@needs_ext
def test_no_gpu_behind_a_cuda_tensor_is_an_error_not_a_crash():
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: fake CUDA tensors would reach it")
    from test_device_gate import DeviceTensor
    a, b = DeviceTensor(8), DeviceTensor(8)
    with pytest.raises(RuntimeError, match="CUDA"):
        CU.multi_scale_([a, b], 2.0, None, None)


# ---- the kernels' thread code (emulated) against the CPU kernels -------------------------------------------------

SIZES = [1, 3, 257, 4096 + 5, 9000]


def _adam_case(layout: str, grad_dtype: torch.dtype, amsgrad: bool, lp: torch.dtype | None, sizes=SIZES, seed=0):
    g = torch.Generator().manual_seed(seed)
    params = [torch.randn(n, generator=g) for n in sizes]
    states = []
    for p in params:
        st = lowbit.new_state(p, layout) if layout != "float32" else {"exp_avg": torch.zeros_like(p),
                                                                        "exp_avg_sq": torch.zeros_like(p)}
        if amsgrad:
            st["max_exp_avg_sq"] = torch.zeros_like(p)
        st["step"] = torch.tensor(0.0)
        states.append({k: v.clone() for k, v in st.items()})
    lps = [torch.empty(n, dtype=lp) for n in sizes] if lp else None
    return params, states, lps, g


def _adam_args(params, states, lps, grads, layout, amsgrad, cfg):
    ms = [s["exp_avg"] for s in states]
    vs = [s["exp_avg_sq"] for s in states]
    maxs = [s["max_exp_avg_sq"] for s in states] if amsgrad else None
    steps = [s["step"] for s in states]
    low = ((None,) * 0)
    if layout == "8bit":
        low = ([s["exp_avg_absmax"] for s in states], [s["exp_avg_sq_absmax"] for s in states], None,
               list(range(len(params))))
    elif layout == "bfloat16":
        low = ([None] * len(params), [None] * len(params), None, list(range(len(params))))
    head = (params, grads, ms, vs, maxs, steps, lps, cfg["lr"], 0.9, 0.999, 1e-8, cfg["wd"], cfg["decoupled"],
            amsgrad, cfg["maximize"], cfg["scale"])
    return head, low


def _clone(xs):
    return None if xs is None else [x.clone() for x in xs]


@needs_ext
@pytest.mark.parametrize("layout,grad_dtype,amsgrad,lp,cfg", [
    ("float32", torch.float32, False, None, dict(lr=1e-3, wd=0.01, decoupled=True, maximize=False, scale=1.0)),
    ("float32", torch.bfloat16, True, torch.bfloat16, dict(lr=3e-3, wd=0.1, decoupled=False, maximize=True,
                                                           scale=0.5)),
    ("float32", torch.float16, False, torch.float16, dict(lr=1e-2, wd=0.0, decoupled=True, maximize=False,
                                                          scale=1.0)),
    ("bfloat16", torch.float32, False, torch.bfloat16, dict(lr=1e-3, wd=0.01, decoupled=True, maximize=False,
                                                            scale=1.0)),
    ("8bit", torch.bfloat16, False, None, dict(lr=1e-3, wd=0.01, decoupled=True, maximize=False, scale=0.25)),
    ("8bit", torch.float32, False, torch.bfloat16, dict(lr=1e-3, wd=0.01, decoupled=True, maximize=False,
                                                         scale=1.0, misalign=True)),
    ("bfloat16", torch.float16, False, None, dict(lr=1e-3, wd=0.01, decoupled=True, maximize=False, scale=1.0,
                                                  misalign=True)),
])
def test_emulated_adam_equals_cpu_kernel(layout, grad_dtype, amsgrad, lp, cfg):
    # misalign: params one element past an aligned address, so the kernels take their per-element paths (else the
    # 4-wide accesses, and the 8-bit kernel's 8 code bytes per lane)
    params, states, lps, g = _adam_case(layout, grad_dtype, amsgrad, lp)
    p2, s2, l2 = _clone(params), [{k: v.clone() for k, v in s.items()} for s in states], _clone(lps)
    if cfg.get("misalign"):
        params, p2 = ([torch.cat([torch.zeros(1), p])[1:] for p in ps] for ps in (params, p2))
    for _ in range(3):
        grads = [torch.randn(p.numel(), generator=g).to(grad_dtype) for p in params]
        head, low = _adam_args(params, states, lps, grads, layout, amsgrad, cfg)
        _C.adam_step(*head, 1, False, None, *low)
        head, low = _adam_args(p2, s2, l2, grads, layout, amsgrad, cfg)
        CU.emulate_adam_step(*head, None, False, *(low or (None, None, None, None)), None)
    for i, (a, b) in enumerate(zip(params, p2)):
        _same(a, b, f"param {i}")
        for k in states[i]:
            _same(states[i][k], s2[i][k], f"state[{k!r}] {i}")
        if lps:
            _same(lps[i], l2[i], f"low-precision copy {i}")


@needs_ext
@pytest.mark.parametrize("layout,amsgrad,offsets,words", [
    ("8bit", True, None, "amsgrad needs max_exp_avg_sq and float32 state"),
    ("bfloat16", True, None, "amsgrad needs max_exp_avg_sq and float32 state"),
    ("8bit", False, [0, 100], "tensor 1: an 8-bit state slice must start on a 256-element block (offset 100)"),
])
def test_cuda_and_cpu_steps_refuse_the_same_arguments_alike(layout, amsgrad, offsets, words):
    """One set of argument rules (optim/adam_check.h) for both steps: the same bad call fails on both with the same
    text, and touches no param."""
    cfg = dict(lr=1e-3, wd=0.01, decoupled=True, maximize=False, scale=1.0)
    for run in (lambda h, lo: _C.adam_step(*h, 1, False, None, *lo),
                lambda h, lo: CU.emulate_adam_step(*h, None, False, *lo, None)):
        params, states, lps, g = _adam_case(layout, torch.float32, amsgrad, None, sizes=(300, 600))
        before = _clone(params)
        head, low = _adam_args(params, states, lps, [torch.randn(p.numel(), generator=g) for p in params], layout,
                               amsgrad, cfg)
        if offsets:
            low = low[:2] + (offsets,) + low[3:]
        with pytest.raises(ValueError, match=re.escape(words)):
            run(head, low)
        for a, b in zip(params, before):
            _same(a, b, "param after a refused step")


@needs_ext
@pytest.mark.parametrize("layout", ["float32", "bfloat16", "8bit"])
def test_emulated_adam_device_mode_graph_inputs(layout):
    """Device mode (CUDA graphs): steps, lr read from 'device' memory and advanced there (the scalars derived on the
    device, the low-precision states' folded ones included), found_inf skipping; many tensors (more than one launch
    holds)."""
    sizes = [5 + 3 * i for i in range(40)] + ([300, 600] if layout != "float32" else [])
    params, states, _, g = _adam_case(layout, torch.float32, False, None, sizes=sizes)
    p2, s2 = _clone(params), [{k: v.clone() for k, v in s.items()} for s in states]
    cfg = dict(lr=2e-3, wd=0.01, decoupled=True, maximize=False, scale=1.0)
    lr_dev = torch.tensor([2e-3], dtype=torch.float32)
    for it in range(3):
        grads = [torch.randn(p.numel(), generator=g) for p in params]
        head, low = _adam_args(params, states, None, grads, layout, False, dict(cfg, lr=float(lr_dev)))
        _C.adam_step(*head, 1, True, None, *low)
        head, low = _adam_args(p2, s2, None, grads, layout, False, cfg)
        head = head[:7] + (lr_dev,) + head[8:]
        CU.emulate_adam_step(*head, None, True, *(low or (None, None, None, None)), torch.zeros(1), True)
    for i in range(len(params)):
        _same(params[i], p2[i], f"param {i}")
        for k in states[i]:
            _same(states[i][k], s2[i][k], f"state[{k!r}] {i}")
        assert float(s2[i]["step"]) == 3.0
    before = _clone(p2)
    head, low = _adam_args(p2, s2, None, grads, layout, False, cfg)
    CU.emulate_adam_step(*head[:7], lr_dev, *head[8:], None, True, *(low or (None, None, None, None)), torch.ones(1),
                         True)
    for i in range(len(p2)):
        _same(before[i], p2[i], f"param {i} after a skipped step")
        assert float(s2[i]["step"]) == 3.0


@needs_ext
@pytest.mark.parametrize("momentum,nesterov,lp", [(0.0, False, None), (0.9, True, torch.bfloat16)])
def test_emulated_sgd_equals_cpu_kernel(momentum, nesterov, lp):
    g = torch.Generator().manual_seed(1)
    params = [torch.randn(n, generator=g) for n in SIZES]
    p2 = _clone(params)
    bufs = [torch.empty(n) for n in SIZES] if momentum else None
    b2 = _clone(bufs)
    lps = [torch.empty(n, dtype=lp) for n in SIZES] if lp else None
    l2 = _clone(lps)
    for it in range(3):
        grads = [torch.randn(n, generator=g).to(torch.bfloat16 if it == 1 else torch.float32) for n in SIZES]
        inits = [it == 0] * len(SIZES) if momentum else None
        args = (grads, bufs, inits, lps, 0.1, momentum, 0.1 if momentum else 0.0, 0.01, nesterov, False, 0.5)
        _C.sgd_step(params, *args, 1)
        CU.emulate_sgd_step(p2, grads, b2, inits, l2, *args[4:], None)
    for i in range(len(SIZES)):
        _same(params[i], p2[i], f"param {i}")
        if bufs:
            _same(bufs[i], b2[i], f"momentum {i}")
        if lps:
            _same(lps[i], l2[i], f"lp {i}")


def _finite_data(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * 100
    x[::97] = torch.tensor([0.0, -0.0, 1e-40, 65504.0, 70000.0, 3e38, -448.0, 1e-8])[
        torch.arange(len(x[::97])) % 8]
    return x


@needs_ext
@pytest.mark.parametrize("dst", [torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2])
def test_emulated_cast_equals_cpu_kernel_and_torch(dst):
    x = _finite_data(4096 * 2 + 13, 2)
    for scale in (None, 0.5, torch.tensor([0.25])):
        a, b = torch.empty(x.shape, dtype=dst), torch.empty(x.shape, dtype=dst)
        am_a, am_b = torch.empty((), dtype=torch.float32), torch.empty(1, dtype=torch.float32)
        _C.cast(x, a, scale, am_a, 1)
        CU.emulate_cast(x, b, scale, am_b, None)
        _same(a, b, f"cast to {dst}, scale {scale}")
        assert float(am_a) == float(am_b) == float(x.abs().max())
        if scale is None and dst in (torch.bfloat16, torch.float16):
            _same(b, x.to(dst), f"cast to {dst} vs torch")
    # the device's NaN: canonical 0x7FFF for bf16 and fp16 outputs (what torch's CUDA conversion writes)
    if dst in (torch.bfloat16, torch.float16):
        nan = torch.tensor([float("nan"), 1.0, -float("nan")])
        out = torch.empty(3, dtype=dst)
        CU.emulate_cast(nan, out, None, None, None)
        assert _bits(out)[0].item() == 0x7FFF and _bits(out)[2].item() == 0x7FFF


@needs_ext
def test_emulated_gradient_passes_equal_cpu_kernels():
    g = torch.Generator().manual_seed(3)
    ts = [torch.randn(n, generator=g).to(dt) for n, dt in zip(SIZES, [torch.float32, torch.bfloat16, torch.float16,
                                                                      torch.float32, torch.bfloat16])]
    for norm_type in (1.0, 2.0, float("inf")):
        out = torch.empty(1, dtype=torch.float32)
        CU.emulate_multi_norm(ts, norm_type, None, out, None)
        ref = _C.multi_norm(ts, norm_type, 1)
        assert float(out) == pytest.approx(ref, rel=1e-7), norm_type
    a, b = _clone(ts), _clone(ts)
    fa, fb = torch.zeros(1), torch.zeros(1)
    _C.multi_scale_(a, 0.125, fa, 1)
    CU.emulate_multi_scale_(b, 0.125, fb, None)
    for x, y in zip(a, b):
        _same(x, y, "multi_scale_")
    assert float(fa) == float(fb) == 0.0
    b[2][7] = float("inf")
    flag = torch.empty(1)
    CU.emulate_nonfinite(b, 1.0, flag, None)
    assert float(flag) == 1.0 and _C.grads_nonfinite(b, 1.0, 1)
    CU.emulate_multi_scale_(b, 2.0, fb, None)
    assert float(fb) == 1.0
    CU.emulate_nonfinite(a, 1.0, flag, None)
    assert float(flag) == 0.0
    a[0][0] = 10.0
    CU.emulate_nonfinite(a, 3e38, flag, None)  # finite values that overflow once scaled
    assert float(flag) == float(_C.grads_nonfinite(a, 3e38, 1)) == 1.0


@needs_ext
def test_emulated_multi_copy_equals_pack():
    """The sharded engine's copy-in on the device: each tensor into its slice of a flat buffer, converted."""
    g = torch.Generator().manual_seed(4)
    srcs = [torch.randn(n, generator=g).to(dt) for n, dt in zip(SIZES, [torch.float32, torch.bfloat16, torch.float16,
                                                                        torch.float32, torch.bfloat16])]
    offsets = [sum(SIZES[:i]) for i in range(len(SIZES))]
    for out_dtype in (torch.float32, torch.bfloat16):
        ref = torch.empty(sum(SIZES), dtype=out_dtype)
        _C.pack(ref, srcs, offsets, 1)
        out = torch.full((sum(SIZES),), 7.0, dtype=out_dtype)
        CU.emulate_multi_copy(srcs, [out[o:o + s.numel()] for o, s in zip(offsets, srcs)], None)
        _same(ref, out, f"copy-in to {out_dtype}")
        back = [torch.empty_like(s) for s in srcs]  # copy-out: the slices back into their tensors
        CU.emulate_multi_copy([out[o:o + s.numel()] for o, s in zip(offsets, srcs)], back, None)
        for o, s, b in zip(offsets, srcs, back):
            _same(b, out[o:o + s.numel()].to(s.dtype), "copy-out")


def test_gpu_check_without_a_gpu_says_so_and_exits_0():
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the script would run for minutes")
    out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gpu_check.py"), "--quick"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("no CUDA device"), out.stdout


def test_gpu_check_training_plumbing_on_the_cpu(tmp_path, monkeypatch):
    # The GPU check's fp16 / exact-resume section, its worker processes on the CPU with a tiny model: the plumbing a
    # GPU session relies on (device time is scarce; a broken script would spend it)
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    import _gpu_train as g
    worker = g._worker
    monkeypatch.setattr(g, "_worker", lambda args, out, timeout, launch=0: worker(
        args + ["--device", "cpu", "--global_batch", "4", "--tiny"], out, timeout, launch))
    results = []
    g.fp16_and_resume(True, str(tmp_path), lambda line: None, lambda name, ok, detail: results.append((name, ok)))
    assert len(results) == 2 and all(ok for _, ok in results), results
