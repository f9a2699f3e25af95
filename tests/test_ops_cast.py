# tests/test_ops_cast.py: accelerate_c.ops (C cast + fused amax, multi-tensor unscale / norm / scale) against
# torch 2.13's own ops, bit for bit where torch is deterministic, on every SIMD path and 1/2 threads.
# Not for: timing (benchmarks/cast.py) or CUDA (the CUDA variants do not exist yet).
#
# Reference sequences: fp8 `x.float().mul(scale).clamp(-max, max).to(dtype)`, others `(x.float()*scale).to(dtype)`
# (`x.to(dtype)` without scale), amax `x.abs().max()`. torch's NaN encodings depend on whether an element went
# through its vectorised loop or its scalar tail (e.g. fp16 NaN -> fp32 is 0x7FFFFFFF in the tail), so arrays
# whose size is a multiple of 64 are compared bit for bit everywhere, and odd sizes bit for bit except that a
# NaN only has to be a NaN.
import math

import numpy as np
import pytest
import torch
from simd_levels import LEVELS, simd

from accelerate_c import _C, ops

F8 = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
OUTS = [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2]
INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


@pytest.fixture(params=LEVELS)
def level(request):
    with simd(request.param):
        yield request.param


@pytest.fixture(params=[1, 2])
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def ref_cast(x, dtype, scale):
    if dtype in F8:
        y = x.float() if scale is None else x.float() * scale
        return y.clamp(-F8[dtype], F8[dtype]).to(dtype)
    return x.to(dtype) if scale is None else (x.float() * scale).to(dtype)


def bits(t):
    return t.contiguous().view(INT[t.element_size()])


def assert_same_bits(out, ref, nan_any=False):
    assert out.dtype == ref.dtype and out.shape == ref.shape
    diff = bits(out) != bits(ref)
    if nan_any:  # a NaN only has to be a NaN (torch's scalar tail uses other NaN patterns)
        diff &= ~(out.float().isnan() & ref.float().isnan())
    if diff.any():
        i = diff.nonzero()[:5].flatten().tolist()
        raise AssertionError(f"{int(diff.sum())} elements differ, e.g. at {i}: ours {bits(out)[i].tolist()} "
                             f"torch {bits(ref)[i].tolist()}")


def assert_amax(amax, x):
    ref = x.abs().max().float() if x.numel() else torch.tensor(0.0)
    assert amax.dtype == torch.float32 and amax.dim() == 0
    if ref.isnan():
        assert amax.isnan()
    else:
        assert bits(amax.reshape(1)).item() == bits(ref.reshape(1)).item()


ALL16 = torch.arange(65536, dtype=torch.int32).to(torch.int16)
# 3: two-bit mantissa, makes ties in every narrower format; 1/3: inexact; 1024 and 2**-20: overflow and
# underflow into subnormals
SCALES = [None, 3.0, 1.0 / 3.0, 1024.0, 2.0 ** -20]
_refs = {}


def _ref_cached(src, dtype, scale):
    key = (src, dtype, scale)
    if key not in _refs:
        _refs[key] = ref_cast(ALL16.view(src), dtype, scale)
    return _refs[key]


@pytest.mark.parametrize("src", [torch.bfloat16, torch.float16])
def test_exhaustive_16bit(level, src):
    x = ALL16.view(src)
    for dtype in OUTS:
        for scale in SCALES:
            out, amax = ops.cast(x, dtype, scale=scale, return_amax=True)
            assert_same_bits(out, _ref_cached(src, dtype, scale))
            assert_amax(amax, x)


def _fp32_cases(n_random=1 << 16):
    rng = np.random.default_rng(1234)
    parts = [rng.integers(0, 2 ** 32, n_random, dtype=np.uint64).astype(np.uint32)]  # all classes incl. NaN, subnormal
    # exact ties for every target width (bf16/fp16/e4m3/e5m2 keep 7/10/3/2 mantissa bits), normal and subnormal
    e = rng.integers(80, 150, 4096).astype(np.uint32)
    for sh in (13, 16, 20, 21, 22, 23):
        m = (rng.integers(0, 1 << max(23 - sh, 1), 4096).astype(np.uint32) << sh) | (1 << (sh - 1))
        parts.append(((e << 23) | (m & 0x7FFFFF) | (rng.integers(0, 2, 4096).astype(np.uint32) << 31)))
    # fp32 subnormals and values next to every fp8/fp16 boundary
    parts.append(rng.integers(1, 1 << 23, 4096).astype(np.uint32))
    special = np.array([0, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00000, 0x7F800001, 0xFFA00001,
                        0x43E00000, 0x43E80000, 0x43E80001, 0x47600000, 0x47700000, 0x477FE000, 0x477FF000,
                        0x477FEFFF, 0x7F7FFFFF, 0x7F7F8000, 0x3C800000, 0x3C7FFFFF, 0x38800000, 0x387FFFFF,
                        0x3B000000, 0x3A800000, 0x37800000, 0x33000000, 0x33000001, 0x00000001],
                       dtype=np.uint32)
    parts.append(np.concatenate([special, special | 0x80000000]))
    b = np.concatenate(parts)
    b = np.concatenate([b, np.zeros((-len(b)) % 64, np.uint32)])  # multiple of 64: torch fully vectorised
    return torch.from_numpy(b.view(np.int32)).view(torch.float32)


FP32 = _fp32_cases()


@pytest.mark.parametrize("dtype", OUTS)
def test_fp32_special_random_ties(level, dtype):
    for scale in (None, 3.0, 1.0 / 3.0, 2.0 ** 10, 2.0 ** -20, torch.tensor(0.75)):
        out, amax = ops.cast(FP32, dtype, scale=scale, return_amax=True)
        assert_same_bits(out, ref_cast(FP32, dtype, scale))
        assert_amax(amax, FP32)


@pytest.mark.parametrize("n", [0, 1, 15, 17, 63, 65, 1000, 4097])
@pytest.mark.parametrize("src", [torch.float32, torch.bfloat16, torch.float16])
def test_odd_sizes_and_alignment(level, n, src):
    g = torch.Generator().manual_seed(n)
    base = (torch.randn(n + 3, generator=g) * 300).to(src)
    if n > 4:
        base[1], base[2], base[3] = float("inf"), float("nan"), -0.0
    for off in (0, 1):  # off=1: input and output not 64-byte aligned (prologue path)
        x = base[off:off + n]
        for dtype in OUTS:
            ref = ref_cast(x, dtype, 0.5)
            buf = torch.empty(n + 1, dtype=dtype)
            out = buf[off:off + n]
            amax = torch.empty((), dtype=torch.float32)
            _C.cast(x, out, 0.5, amax, 1)
            assert_same_bits(out, ref, nan_any=True)
            assert_amax(amax, x)


def test_two_threads_and_streaming_stores(level):
    # > 2 * 1M elements: really split over 2 threads; >= 16 MiB of output: non-temporal stores
    for n, dtype in ((2_100_001, torch.float8_e4m3fn), ((8 << 20) + 37, torch.bfloat16)):
        x = torch.randn(n) * 100
        x[n // 2] = float("inf")
        for nt in (1, 2):
            out, amax = torch.empty(n, dtype=dtype), torch.empty((), dtype=torch.float32)
            _C.cast(x, out, 2.0, amax, nt)
            assert_same_bits(out, ref_cast(x, dtype, 2.0), nan_any=True)
            assert amax.item() == math.inf


def test_out_argument():
    x = torch.randn(1000) * 300
    out = torch.empty(1000, dtype=torch.float8_e4m3fn)
    y, amax = ops.cast(x, torch.float8_e4m3fn, scale=0.5, return_amax=True, out=out)
    assert y.data_ptr() == out.data_ptr()
    assert_same_bits(out, ref_cast(x, torch.float8_e4m3fn, 0.5))
    assert_amax(amax, x)
    strided = torch.empty(1000, 2, dtype=torch.float8_e4m3fn)[:, 0]  # non-contiguous out: torch path, same bits
    y = ops.cast(x, torch.float8_e4m3fn, scale=0.5, out=strided)
    assert y.data_ptr() == strided.data_ptr()
    assert_same_bits(strided, ref_cast(x, torch.float8_e4m3fn, 0.5))


def test_amax_nan_and_zero():
    x = torch.tensor([-0.0, 0.0, -0.0])
    _, amax = ops.cast(x, torch.float8_e4m3fn, return_amax=True)
    assert bits(amax.reshape(1)).item() == 0  # +0, like x.abs().max()
    x = torch.randn(1000)
    x[777] = float("nan")
    _, amax = ops.cast(x, torch.bfloat16, return_amax=True)
    assert amax.isnan()
    _, amax = ops.cast(torch.empty(0), torch.float16, return_amax=True)
    assert amax.item() == 0.0


def test_fallbacks_match_torch():
    x = torch.randn(64, 33) * 500
    assert_same_bits(ops.cast(x.t(), torch.float8_e5m2, scale=3.0), ref_cast(x.t(), torch.float8_e5m2, 3.0))
    x64 = x.double()  # dtype the kernel does not take: torch path
    assert_same_bits(ops.cast(x64, torch.float8_e4m3fn), ref_cast(x64, torch.float8_e4m3fn, None))


# ---- multi-tensor passes -------------------------------------------------------------------------------------


def _grads(seed, with_inf=False):
    g = torch.Generator().manual_seed(seed)
    gs = [torch.randn(n, generator=g) * 10 for n in (1, 17, 4096, 2_100_000)]  # 2.1M: split over 2 threads
    gs += [torch.randn(n, generator=g).to(torch.bfloat16) for n in (3, 1000, 70_000)]
    gs += [torch.randn(n, generator=g).to(torch.float16) for n in (5, 2049)]
    gs.append(torch.empty(0))
    if with_inf:
        gs[5][10] = float("inf")
    return gs


@pytest.mark.parametrize("inv", [0.5, 1.0, 1.0 / 65536.0])
@pytest.mark.parametrize("with_inf", [False, True])
def test_unscale_vs_torch(level, threads, inv, with_inf):
    ours, ref = _grads(3, with_inf), _grads(3, with_inf)
    fi_o, fi_r = torch.zeros(1), torch.zeros(1)
    inv_t = torch.tensor([inv])
    ops.non_finite_check_and_unscale_(ours, fi_o, inv_t)
    torch._amp_foreach_non_finite_check_and_unscale_(ref, fi_r, inv_t)
    assert fi_o.item() == fi_r.item() == (1.0 if with_inf else 0.0)
    for a, b in zip(ours, ref):
        assert_same_bits(a, b, nan_any=True)
    # a huge value that overflows only after scaling is not flagged (torch checks before scaling)
    g = [torch.tensor([3e38, 1.0])]
    fi = torch.zeros(1)
    ops.non_finite_check_and_unscale_(g, fi, torch.tensor([10.0]))
    assert fi.item() == 0.0 and math.isinf(g[0][0].item())


@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf, 3.0])
def test_global_norm(level, threads, norm_type):
    gs = _grads(5)
    got = ops.global_norm(gs, norm_type)
    exact = torch.linalg.vector_norm(torch.cat([g.double().flatten() for g in gs]), norm_type)
    # fp64 accumulation: only the final rounding to fp32 remains
    assert got.dtype == torch.float32 and abs(got.item() - exact.item()) <= 2e-7 * exact.item()
    fp32 = [g for g in gs if g.dtype == torch.float32 and g.numel()]  # torch's inf-norm rejects empty tensors
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in fp32]
    for p, g in zip(params, fp32):
        p.grad = g.clone()
    torch_total = torch.nn.utils.clip_grad_norm_(params, 1e30, norm_type)
    # torch accumulates fp32 grads in fp32: over these 2.1M elements it is off the exact norm by up to
    # ~3e-5 (p=2) / ~3e-4 (p=1) relative, so it is compared with that tolerance (ours is the exact one)
    tol = 0.0 if math.isinf(norm_type) else 1e-3
    assert abs(ops.global_norm(fp32, norm_type).item() - torch_total.item()) <= tol * torch_total.item()
    bad = [torch.tensor([1.0, float("nan")]), torch.tensor([float("inf")])]
    assert math.isnan(ops.global_norm(bad, norm_type).item())
    assert math.isinf(ops.global_norm(bad[1:], norm_type).item())


def test_scale_and_clip_vs_torch(level, threads):
    ours, ref = _grads(7), _grads(7)
    ops.scale_(ours, 0.3)
    torch._foreach_mul_(ref, torch.tensor(0.3))
    for a, b in zip(ours, ref):
        assert_same_bits(a, b)
    fp32 = [g for g in _grads(9) if g.dtype == torch.float32]
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in fp32]
    for p, g in zip(params, fp32):
        p.grad = g.clone()
    total_ref = torch.nn.utils.clip_grad_norm_(params, 1.0)  # torch's fp32-accumulated norm: see test_global_norm
    exact = torch.linalg.vector_norm(torch.cat([g.double() for g in fp32])).float()
    coef = torch.clamp(1.0 / (exact + 1e-6), max=1.0)  # torch's formula, applied to the exact norm
    expect = [g * coef for g in fp32]
    total = ops.clip_grad_norm_(fp32, 1.0)
    assert abs(total.item() - exact.item()) <= 2e-7 * exact.item()
    assert abs(total.item() - total_ref.item()) <= 1e-3 * total_ref.item()
    for g, e, p in zip(fp32, expect, params):
        torch.testing.assert_close(g, e, rtol=2e-7, atol=0)  # same coefficient up to 1 ulp of the norm
        torch.testing.assert_close(g, p.grad, rtol=1e-3, atol=0)


def test_multi_fallback_noncontiguous():
    m = torch.randn(40, 30)
    gs, ref = [m.t(), torch.randn(100)], [m.clone().t(), None]
    ref[1] = gs[1].clone()
    fi = torch.zeros(1)
    ops.non_finite_check_and_unscale_(gs, fi, torch.tensor([0.25]))
    torch._amp_foreach_non_finite_check_and_unscale_(ref, torch.zeros(1), torch.tensor([0.25]))
    for a, b in zip(gs, ref):
        assert torch.equal(a, b)


def test_opcheck():
    x = torch.randn(3, 17) * 100
    gs = [torch.randn(100), torch.randn(37).to(torch.bfloat16)]
    cases = [
        (torch.ops.accelerate_c.cast.default, (x, torch.float8_e4m3fn, torch.tensor(2.0))),
        (torch.ops.accelerate_c.cast.default, (x, torch.bfloat16, None)),
        (torch.ops.accelerate_c.cast_amax.default, (x.bfloat16(), torch.float8_e5m2, torch.tensor(0.5))),
        (torch.ops.accelerate_c.global_norm.default, (gs, 2.0)),
        (torch.ops.accelerate_c.scale_.default, (gs, torch.tensor(0.5))),
        (torch.ops.accelerate_c.non_finite_check_and_unscale_.default, (gs, torch.zeros(1), torch.tensor([0.5]))),
    ]
    for op, args in cases:
        torch.library.opcheck(op, args)
