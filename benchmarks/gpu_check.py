# benchmarks/gpu_check.py: the one device check of issue 24 (docs/gpu.md), run as one command on a machine with a
# CUDA GPU: builds accelerate_c._C and _C_cuda in place when they are missing or older than their sources, then prints
# correctness first (each CUDA kernel against the CPU kernel and against torch, CUDA graph capture and a non-default
# stream against eager), then speed with every baseline from the same run (torch's fused AdamW, a device copy of the
# same bytes, torch's casts), then training (benchmarks/_gpu_train.py: the demo GPT and a transformers Llama in bf16
# against the plain autocast loop and HF Accelerate, fp8 against bf16, two processes on the one GPU against one; fp16
# with torch's GradScaler against the plain loop, and save_state / load_state resuming bit for bit), and
# appends the output with the exact command to benchmarks/RESULTS.md (--no-record: not).
#   python benchmarks/gpu_check.py [--quick] [--no-record] [--skip-train] [--rounds N]
# Exit codes: 0 done (or no CUDA device: it says "no CUDA device" and measures nothing), 1 a correctness check failed,
# 2 the build failed or _C_cuda cannot be loaded. On one H200, the build (12-17 s) included: 135 s with one training
# round, 271 s with two (--rounds 2), 23 s with --skip-train.
# Not for: the CPU benchmarks (the other scripts here) or tests (tests/test_cuda_ext.py runs the kernels' code on the
# CPU).
from __future__ import annotations

import argparse
import glob
import os
import subprocess
import sys
import time
import traceback

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
LINES: list[str] = []
FAILED: list[str] = []


def say(line: str = "") -> None:
    print(line, flush=True)
    LINES.append(line)


def check(name: str, ok: bool, detail: str) -> None:
    say(f"  [{'ok' if ok else 'FAIL'}] {name}: {detail}")
    if not ok:
        FAILED.append(name)


def section(title: str, fn, *args) -> None:
    say(f"\n== {title}")
    t = time.perf_counter()
    try:
        fn(*args)
    except Exception as e:  # one section's failure must not hide the others' figures
        say(f"  [FAIL] {title}: {type(e).__name__}: {e}")
        say("    " + traceback.format_exc().strip().splitlines()[-3])
        FAILED.append(title)
    say(f"  ({time.perf_counter() - t:.1f} s)")


# ---- build -----------------------------------------------------------------------------------------------------

def ensure_built() -> None:
    """_C and _C_cuda in place, rebuilt when missing or older than a source (the GPU machine has no package index:
    setup.py needs only setuptools, a C compiler and nvcc)."""
    srcs = glob.glob(os.path.join(ROOT, "csrc", "**", "*.[ch]"), recursive=True) + \
        glob.glob(os.path.join(ROOT, "csrc", "cuda", "*.cu"))
    newest = max(os.path.getmtime(s) for s in srcs)
    sos = [glob.glob(os.path.join(ROOT, "accelerate_c", f"{m}.*so")) for m in ("_C", "_C_cuda")]
    if all(found and os.path.getmtime(found[0]) >= newest for found in sos):
        say("build: accelerate_c._C and _C_cuda are current")
        return
    t = time.perf_counter()
    env = dict(os.environ, ACCELERATE_C_CUDA_BUILD="1")
    cmd = [sys.executable, "setup.py", "-q", "build_ext", "--inplace", "--parallel", "2"]  # (_C and _C_cuda at once)
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    if p.returncode:
        print(p.stdout[-3000:] + p.stderr[-3000:])
        say(f"build failed ({p.returncode}); see above. Is nvcc on PATH or in /usr/local/cuda/bin?")
        sys.exit(2)
    say(f"build: setup.py build_ext --inplace in {time.perf_counter() - t:.0f} s")


# ---- timing ----------------------------------------------------------------------------------------------------

def gtime(fn, reps: int, warm: int = 2) -> float:
    """Seconds per call on the device (CUDA events around `reps` calls)."""
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / reps / 1e3


def copy_bound(nbytes_moved: int, reps: int) -> float:
    """Seconds of a device copy moving the same bytes (read + write)."""
    src = torch.empty(nbytes_moved // 2, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    t = gtime(lambda: dst.copy_(src), reps)
    del src, dst
    return t


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def ndiff(a: torch.Tensor, b: torch.Tensor) -> int:
    a, b = a.cpu().contiguous(), b.cpu().contiguous()
    w = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[a.element_size()]
    return int((a.view(w) != b.view(w)).sum())


# ---- Adam state in each layout --------------------------------------------------------------------------------

class AdamSet:
    """Params, grads and state (layout float32 / bfloat16 / 8bit) on a device, stepped by the C or CUDA kernel."""

    def __init__(self, sizes: list[int], layout: str, device: str, seed: int = 0) -> None:
        from accelerate_c.optim import lowbit
        self.layout, self.device = layout, device
        if sum(sizes) <= 1 << 22:  # the correctness sets: the same values on the CPU and the GPU
            g = torch.Generator().manual_seed(seed)
            self.params = [torch.randn(n, generator=g).to(device) for n in sizes]
            self.grads = [torch.randn(n, generator=g).to(device) for n in sizes]
        else:  # the speed sets: drawn on the device (the CPU would take seconds)
            g = torch.Generator(device=device).manual_seed(seed)
            self.params = [torch.randn(n, generator=g, device=device) for n in sizes]
            self.grads = [torch.randn(n, generator=g, device=device) for n in sizes]
        self.states = [lowbit.new_state(p, layout) if layout != "float32" else
                       {"exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)} for p in self.params]

    def args(self, step: float | list, lr) -> tuple:
        ms = [s["exp_avg"] for s in self.states]
        vs = [s["exp_avg_sq"] for s in self.states]
        return (self.params, self.grads, ms, vs, None, step, None, lr, 0.9, 0.999, 1e-8, 0.01, True, False, False,
                1.0)

    def low(self) -> tuple | None:
        n = len(self.params)
        if self.layout == "8bit":
            return ([s["exp_avg_absmax"] for s in self.states], [s["exp_avg_sq_absmax"] for s in self.states], None,
                    list(range(n)))
        return ([None] * n, [None] * n, None, list(range(n))) if self.layout == "bfloat16" else None

    def step_cuda(self, step: float | list, lr=1e-3) -> None:
        from accelerate_c.optim import cuda
        cuda.adam_step(torch.device("cuda"), *self.args(step, lr), isinstance(lr, torch.Tensor), low=self.low())

    def step_cpu(self, step: float) -> None:
        from accelerate_c import _C
        low = self.low()
        _C.adam_step(*self.args(step, 1e-3), torch.get_num_threads(), False, None, *(low or ()))

    def tensors(self) -> list[torch.Tensor]:
        return self.params + [t for s in self.states for t in s.values()]


GPT2_SMALL = ([50257 * 768, 1024 * 768] + [768, 768, 768 * 2304, 2304, 768 * 768, 768, 768, 768, 768 * 3072, 3072,
                                           3072 * 768, 768] * 12 + [768, 768])


# ---- correctness -------------------------------------------------------------------------------------------------

def correctness_optim() -> None:
    sizes = [1, 3, 257, 4096 * 3 + 5, 100_000]
    for layout in ("float32", "bfloat16", "8bit"):
        dev, cpu = AdamSet(sizes, layout, "cuda"), AdamSet(sizes, layout, "cpu")
        for s in (1.0, 2.0, 3.0):
            dev.step_cuda(s)
            cpu.step_cpu(s)
        torch.cuda.synchronize()
        diffs = sum(ndiff(a, b) for a, b in zip(dev.tensors(), cpu.tensors()))
        worst = max(rel(a, b) for a, b in zip(dev.params, cpu.params))
        check(f"adam {layout} state vs CPU kernel", worst <= 1e-6,
              f"{diffs} differing elements (params and state), max rel diff of params {worst:.2e}")
    # fp32 against torch's fused AdamW (its own rounding: a tolerance)
    ours = AdamSet(sizes, "float32", "cuda")
    ref = [p.clone().requires_grad_() for p in ours.params]
    opt = torch.optim.AdamW(ref, lr=1e-3, weight_decay=0.01, fused=True)
    for s in (1.0, 2.0, 3.0):
        ours.step_cuda(s)
        for p, g in zip(ref, ours.grads):
            p.grad = g
        opt.step()
    worst = max(rel(a, b.detach()) for a, b in zip(ours.params, ref))
    check("adam fp32 vs torch.optim.AdamW(fused=True)", worst <= 1e-5, f"max rel diff {worst:.2e}")
    # SGD with momentum through the Python dispatch (fused_step on torch's own SGD)
    from accelerate_c.optim import fused_step
    g = torch.Generator().manual_seed(5)
    base = [torch.randn(n, generator=g) for n in sizes]
    grads = [torch.randn(n, generator=g) for n in sizes]
    a = [torch.nn.Parameter(t.cuda()) for t in base]
    b = [torch.nn.Parameter(t.cuda()) for t in base]
    oa = torch.optim.SGD(a, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01)
    ob = torch.optim.SGD(b, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01)
    for _ in range(3):
        for p, q, gr in zip(a, b, grads):
            p.grad, q.grad = gr.cuda(), gr.cuda()
        took = fused_step(oa)
        ob.step()
    check("sgd (fused_step on torch.optim.SGD) vs torch", took is True and max(rel(x, y) for x, y in zip(a, b)) <= 1e-6,
          f"fused_step returned {took}, max rel diff {max(rel(x, y) for x, y in zip(a, b)):.2e}")


def correctness_ops() -> None:
    from accelerate_c import _C
    from accelerate_c.optim import cuda, gradops
    from accelerate_c.precision.cast import FP8_MAX, cast
    g = torch.Generator().manual_seed(7)
    x = (torch.randn(1 << 20, generator=g) * 50)
    x[::1001] = 3e38
    xc = x.cuda()
    for dt in (torch.bfloat16, torch.float16):
        n = ndiff(cast(xc, dt), xc.to(dt))
        check(f"cast fp32->{str(dt)[6:]} vs torch .to()", n == 0, f"{n} differing elements")
    for dt in (torch.float8_e4m3fn, torch.float8_e5m2):
        out, amax = cast(xc, dt, scale=0.125, return_amax=True)
        cpu = torch.empty(x.shape, dtype=dt)
        am = torch.empty((), dtype=torch.float32)
        _C.cast(x, cpu, 0.125, am, torch.get_num_threads())
        ref = (xc * 0.125).clamp(-FP8_MAX[dt], FP8_MAX[dt]).to(dt)
        check(f"cast fp32->{str(dt)[6:]} + amax vs CPU kernel and torch", ndiff(out, cpu) == 0 and ndiff(out, ref) == 0
              and float(amax) == float(am) == float(x.abs().max()),
              f"{ndiff(out, cpu)} / {ndiff(out, ref)} differing elements, amax {float(amax)} vs {float(am)}")
    # the special values: NaN of either sign, infinities, fp32 and float8 subnormals, ties, the saturation edges
    sp = torch.tensor([float("nan"), -float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e-40, -1e-40, 1e-3,
                       -7e-4, 2 ** -10, 3 * 2 ** -11, 447.9, 448.0, 463.9, 464.0, 480.0, -500.0, 57343.0, 57344.0,
                       61439.0, 61440.0, -65504.0, 65520.0, 3e38, 1.00048828125, 1.0009765625])
    xs = torch.cat([sp.repeat(41), (torch.randn(4096, generator=g) * 300)])
    xs_c = xs.cuda()
    for dt in (torch.bfloat16, torch.float16):
        n = ndiff(cast(xs_c, dt), xs_c.to(dt))
        check(f"cast fp32->{str(dt)[6:]} of NaN/inf/subnormal/ties vs torch .to()", n == 0, f"{n} differing elements")
    for dt in (torch.float8_e4m3fn, torch.float8_e5m2):
        for scale in (1.0, 0.125):
            out, amax = cast(xs_c, dt, scale=scale, return_amax=True)
            cpu = torch.empty(xs.shape, dtype=dt)
            am = torch.empty((), dtype=torch.float32)
            _C.cast(xs, cpu, scale, am, torch.get_num_threads())
            ref = (xs_c * scale).clamp(-FP8_MAX[dt], FP8_MAX[dt]).to(dt)
            same_amax = ndiff(amax.reshape(1).cpu(), am.reshape(1)) == 0
            # A GPU's multiply returns the canonical (positive) NaN, an x86 one keeps the input's: after a scale,
            # -NaN gives 0x7F on the device (torch's CUDA expression too) and 0xFF on the CPU. Only there may the
            # two kernels differ, and only in the NaN code's sign.
            codes, cpu_codes = out.cpu().view(torch.uint8), cpu.view(torch.uint8)
            where = (codes != cpu_codes).nonzero().flatten()
            nan_only = bool(torch.isnan(xs[where]).all()) and bool(((codes[where] & 0x7F) == 0x7F).all())
            inputs = sorted({f"{float(v)}(bits {int(b) & 0xFFFFFFFF:#x})" for v, b in
                             zip(xs[where][:50].tolist(), xs.view(torch.int32)[where][:50].tolist())})
            check(f"cast fp32->{str(dt)[6:]} (scale {scale}) of NaN/inf/subnormal/ties vs torch, and vs the CPU "
                  "kernel up to a NaN's sign", ndiff(out, ref) == 0 and nan_only and same_amax,
                  f"{ndiff(out, ref)} differing from torch; {len(where)} from the CPU kernel, at inputs {inputs}; "
                  f"amax bits {'equal' if same_amax else 'differ'}")
    ts = [torch.randn(n, generator=g).to(d).cuda() for n, d in
          [(1000, torch.float32), (77777, torch.bfloat16), (5, torch.float16), (300_000, torch.float32)]]
    for p in (1.0, 2.0, float("inf")):
        ours = float(gradops.global_norm(ts, p))
        cpu = _C.multi_norm([t.cpu() for t in ts], p, torch.get_num_threads())
        ref = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(t.double(), p) for t in ts]), p))
        check(f"global norm p={p} vs CPU kernel and torch (fp64)", abs(ours - cpu) <= 1e-6 * cpu and
              abs(ours - ref) <= 1e-6 * ref, f"{ours!r} / {cpu!r} / {ref!r}")
    params = [torch.nn.Parameter(torch.zeros_like(t, dtype=torch.float32)) for t in ts]
    for q, t in zip(params, ts):
        q.grad = t.float() * 3
    ref_grads = [q.grad.clone() for q in params]
    total = gradops.clip_grad_norm_([q.grad for q in params], 1.0)
    ref_params = [torch.nn.Parameter(torch.zeros_like(q)) for q in params]
    for q, g0 in zip(ref_params, ref_grads):
        q.grad = g0
    ref_total = torch.nn.utils.clip_grad_norm_(ref_params, 1.0)
    worst = max(rel(q.grad, r.grad) for q, r in zip(params, ref_params))
    check("clip_grad_norm_ (norm + scale on the device) vs torch", worst <= 1e-5 and rel(total, ref_total) <= 1e-5,
          f"total {float(total):.6g} vs {float(ref_total):.6g}, max rel diff of the clipped grads {worst:.1e}")
    a, b = [t.clone() for t in ts], [t.clone() for t in ts]
    found = torch.zeros(1, device="cuda")
    gradops.non_finite_check_and_unscale_(a, found, torch.tensor([0.5], device="cuda"))
    found_t = torch.zeros(1, device="cuda")
    # torch's kernel takes fp32/fp16 only (not bf16, whose reference is the exact multiply by 0.5 and an isfinite)
    torch._amp_foreach_non_finite_check_and_unscale_([t for t in b if t.dtype != torch.bfloat16], found_t,
                                                     torch.tensor([0.5], device="cuda"))
    for t in (t for t in b if t.dtype == torch.bfloat16):
        found_t += (~torch.isfinite(t)).any().float()
        t.mul_(0.5)
    check("unscale (multi_scale_) vs torch._amp_foreach_non_finite_check_and_unscale_",
          sum(ndiff(u, v) for u, v in zip(a, b)) == 0 and float(found) == float(found_t) == 0.0, "bit-identical")
    a[1][3] = float("nan")
    flag = cuda.nonfinite_flag(a, 1.0)
    check("non-finite check", float(flag) == 1.0, f"flag {float(flag)} with a NaN")
    srcs = [t for t in ts]
    out = torch.empty(sum(t.numel() for t in ts), dtype=torch.bfloat16, device="cuda")
    from accelerate_c.sharding.pack import pack
    offs = [sum(t.numel() for t in ts[:i]) for i in range(len(ts))]
    pack(out, offs, srcs)
    ref = torch.cat([t.to(torch.bfloat16) for t in ts])
    check("copy-in (sharding pack, multi_copy) vs torch", ndiff(out, ref) == 0, f"{ndiff(out, ref)} differing")


def correctness_graph_stream() -> None:
    """Device-mode steps (step count and lr on the device): CUDA graph replays and a side stream equal eager."""
    sizes = [4096 * 5 + 1, 1000, 77]
    eager, graph, side = (AdamSet(sizes, "float32", "cuda", seed=3) for _ in range(3))
    lr = torch.tensor(1e-3, device="cuda")
    steps = {k: [torch.zeros((), device="cuda") for _ in sizes] for k in ("eager", "graph", "side")}
    for _ in range(3):
        eager.step_cuda(steps["eager"], lr)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            side.step_cuda(steps["side"], lr)
    torch.cuda.current_stream().wait_stream(s)
    cg = torch.cuda.CUDAGraph()
    with torch.cuda.graph(cg):
        graph.step_cuda(steps["graph"], lr)
    for _ in range(3):
        cg.replay()
    torch.cuda.synchronize()
    from accelerate_c.optim import cuda
    dev = torch.device("cuda")
    mine = [cuda.stream(dev) == torch.cuda.current_stream().cuda_stream]
    with torch.cuda.stream(s):
        mine.append(cuda.stream(dev) == s.cuda_stream != torch.cuda.default_stream().cuda_stream)
    check("the kernels' stream handle is torch's current stream (default, then a side stream)", all(mine), str(mine))
    for name, other in (("CUDA graph (3 replays)", graph), ("non-default stream", side)):
        n = sum(ndiff(a, b) for a, b in zip(other.tensors(), eager.tensors()))
        worst = max(rel(a, b) for a, b in zip(other.params, eager.params))
        check(f"adam {name} vs eager", worst <= 1e-6, f"{n} differing elements, max rel diff {worst:.2e}, steps "
              f"{[float(t) for t in steps['graph' if 'graph' in name else 'side']]}")


def correctness_nccl() -> None:
    """NCCL with world size 1 through the code the strategies use for device tensors (comm.group_for_device)."""
    import socket

    import torch.distributed as dist

    from accelerate_c.comm.group import TorchGroup, group_for_device
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                            device_id=torch.device("cuda", 0))
    try:
        grp = group_for_device(torch.device("cuda"))
        x = torch.arange(1000, dtype=torch.float32, device="cuda")
        got = {"all_reduce": grp.all_reduce(x.clone()), "broadcast": grp.broadcast(x.clone(), 0)}
        out = torch.empty_like(x)
        got["all_gather"] = grp.all_gather(out, x.clone())
        out2 = torch.empty_like(x)
        got["reduce_scatter"] = grp.reduce_scatter(out2, x.clone())
        grp.all_reduce_async(y := x.clone()).wait()
        got["all_reduce_async"] = y
        bad = [k for k, v in got.items() if not torch.equal(v, x)]
        check("NCCL (world size 1) through comm.group_for_device: all_reduce, broadcast, all_gather, reduce_scatter",
              isinstance(grp, TorchGroup) and dist.get_backend() == "nccl" and not bad,
              f"{type(grp).__name__} on {dist.get_backend()}; differing: {bad or 'none'}")
    finally:
        dist.destroy_process_group()


# ---- speed ---------------------------------------------------------------------------------------------------------

def speed_optim(quick: bool) -> None:
    n = (64 if quick else 256) << 20
    reps = 5 if quick else 10
    for label, sizes in ((f"flat {n >> 20}M", [n]), ("GPT-2 small list", GPT2_SMALL)):
        total = sum(sizes)
        ours = AdamSet(sizes, "float32", "cuda")
        t_ours = gtime(lambda: ours.step_cuda(1.0), reps)
        ref = [p.clone().requires_grad_() for p in ours.params]
        for p, g in zip(ref, ours.grads):
            p.grad = g
        opt = torch.optim.AdamW(ref, lr=1e-3, weight_decay=0.01, fused=True)
        t_torch = gtime(opt.step, reps)
        del ref, opt
        t_copy = copy_bound(28 * total, reps)
        say(f"  AdamW fp32, {label} ({total / 1e6:.0f}M): ours {t_ours * 1e3:.2f} ms, torch fused "
            f"{t_torch * 1e3:.2f} ms ({t_torch / t_ours:.2f}x), copy bound {t_copy * 1e3:.2f} ms "
            f"({t_copy / t_ours:.0%} of it)")
        if label.startswith("flat"):
            for layout, nbytes, want in (("bfloat16", 20, 1.3), ("8bit", 16, 1.5)):
                del ours
                ours = AdamSet(sizes, layout, "cuda")
                t_low = gtime(lambda: ours.step_cuda(1.0), reps)
                t_c = copy_bound(nbytes * total, reps)
                say(f"  AdamW {layout} state, {label}: ours {t_low * 1e3:.2f} ms = {t_torch / t_low:.2f}x torch fused "
                    f"fp32 (target {want}x), copy bound {t_c * 1e3:.2f} ms ({t_c / t_low:.0%})")
        del ours
        torch.cuda.empty_cache()


def speed_ops(quick: bool) -> None:
    from accelerate_c.optim import cuda
    from accelerate_c.precision.cast import cast
    n = (64 if quick else 256) << 20
    reps = 5 if quick else 10
    x = torch.randn(n, device="cuda")
    for dt, per in ((torch.bfloat16, 6), (torch.float16, 6)):
        out = torch.empty(n, dtype=dt, device="cuda")
        t_ours = gtime(lambda: cuda.cast(x, out, None, None), reps)
        t_torch = gtime(lambda: x.to(dt), reps)
        t_copy = copy_bound(per * n, reps)
        say(f"  cast fp32->{str(dt)[6:]} {n >> 20}M: ours {t_ours * 1e3:.2f} ms, torch .to() {t_torch * 1e3:.2f} ms, "
            f"copy bound {t_copy * 1e3:.2f} ms ({t_copy / t_ours:.0%} of it; target 90%)")
    out8 = torch.empty(n, dtype=torch.float8_e4m3fn, device="cuda")
    amax, s = torch.empty((), device="cuda"), torch.tensor([0.5], device="cuda")
    t_ours = gtime(lambda: cuda.cast(x, out8, s, amax), reps)
    t_torch = gtime(lambda: ((x * s).clamp(-448, 448).to(torch.float8_e4m3fn), x.abs().max()), reps)
    t_copy = copy_bound(5 * n, reps)
    say(f"  fp8 e4m3 cast + amax {n >> 20}M: ours {t_ours * 1e3:.2f} ms (one pass), torch {t_torch * 1e3:.2f} ms, "
        f"copy bound {t_copy * 1e3:.2f} ms ({t_copy / t_ours:.0%}; target 85%)")
    del x, out8
    tiny, tout = torch.ones(1, device="cuda"), torch.empty(1, dtype=torch.bfloat16, device="cuda")
    mod, stream = cuda.kernels(), cuda.stream(tiny.device)
    for label, fn in (("accelerate_c.optim.cuda.cast", lambda: cuda.cast(tiny, tout, None, None)),
                      ("_C_cuda.cast (stream given)", lambda: mod.cast(tiny, tout, None, None, stream)),
                      ("torch copy_ (reference)", lambda: tout.copy_(tiny))):
        for _ in range(200):
            fn()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(5000):
            fn()
        host = (time.perf_counter() - t) / 5000
        torch.cuda.synchronize()
        say(f"  launch overhead, {label}: {host * 1e6:.1f} us per call on the host (target <= 10)")
    small = AdamSet([768] * 40, "float32", "cuda")
    t = time.perf_counter()
    for _ in range(200):
        small.step_cuda(1.0)
    host = (time.perf_counter() - t) / 200
    torch.cuda.synchronize()
    say(f"  launch overhead, fused AdamW over 40 tensors: {host * 1e6:.1f} us per step on the host")


def main() -> int:
    p = argparse.ArgumentParser(description="the GPU check of issue 24 (docs/gpu.md)")
    p.add_argument("--quick", action="store_true", help="smaller buffers, fewer steps (a rerun)")
    p.add_argument("--no-record", action="store_true", help="do not append to benchmarks/RESULTS.md")
    p.add_argument("--skip-train", action="store_true", help="kernels only")
    p.add_argument("--rounds", type=int, default=1, help="training runs per library (the fastest counts; each round "
                   "adds about 70 s on an H200)")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print(f"no CUDA device: torch {torch.__version__} sees none here, so nothing was built or measured "
              "(exit 0; docs/gpu.md)")
        return 0
    start = time.perf_counter()
    sys.path[:0] = [ROOT, HERE]
    say(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}, "
        f"python {sys.version.split()[0]}")
    ensure_built()
    from accelerate_c.optim import cuda
    if cuda.kernels() is None:
        say(f"accelerate_c._C_cuda is not usable: {cuda.why_not()}")
        return 2
    say(f"_C_cuda: {cuda.kernels().info()}")
    section("correctness: optimizers (CUDA vs the CPU kernel, vs torch)", correctness_optim)
    section("correctness: casts, norms, unscale, non-finite, copy-in", correctness_ops)
    section("correctness: CUDA graph capture and a non-default stream vs eager", correctness_graph_stream)
    section("correctness: NCCL with world size 1", correctness_nccl)
    section("speed: fused AdamW", speed_optim, args.quick)
    section("speed: casts and launch overhead", speed_ops, args.quick)
    if not args.skip_train:
        import tempfile
        with tempfile.TemporaryDirectory() as tmp:
            from _gpu_train import fp16_and_resume, training
            section("training (one GPU, bf16/fp8; two processes on it)", training, args.quick, tmp, say, check,
                    args.rounds)
            section("fp16 (GradScaler) and an exact resume on the GPU", fp16_and_resume, args.quick, tmp, say, check)
    say(f"\ntotal {time.perf_counter() - start:.0f} s; {'FAILED: ' + ', '.join(FAILED) if FAILED else 'all checks ok'}")
    if not args.no_record:
        from _results import append_results
        append_results("gpu_check (issue 24)", ["```", *LINES, "```"])
    return 1 if FAILED else 0


if __name__ == "__main__":
    sys.exit(main())
