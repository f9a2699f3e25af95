# optimizer.py: benchmark of accelerate_c's fused CPU AdamW against torch.optim.AdamW (foreach=True and
# fused=True) on a GPT-2-small-shaped parameter list (~124M params in 148 tensors) and on one 256M-param flat
# buffer, plus the mixed-precision step (fp32 master + bf16 model copy) against torch's fused AdamW followed by
# a bf16 copy pass, and a memcpy of >= 1 GiB in the same run as the bandwidth yardstick.
# Prints ms, Gparam/s, ratios and % of the memory-traffic bound (28 B/param fp32, 30 with the bf16 copy, at the
# memcpy bandwidth). Median of >= 5 reps, methods interleaved. --quick: small smoke run (no RESULTS.md).
# Note: memcpy moves 1 read : 1 write, Adam 16 : 12 bytes; DRAM delivers more bandwidth to read-heavy mixes, so
# a memory-bound Adam can show > 100 % of this memcpy-based bound.
# --lowbit: accelerate_c.optim.AdamW with bf16 and 8-bit state against torch's fused fp32 AdamW on the same list
# (state bytes held, speed, % of each one's bytes-per-parameter bound: 28 fp32, 20 bf16, 16.06 8-bit) and the
# bitsandbytes / torchao AdamW8bit anchors when importable (install them with pip --no-deps --target DIR and put
# DIR on PYTHONPATH: pip must never replace torch). Here the 1 GiB copy is one more method of the interleaved reps
# (the host's copy bandwidth swings between runs), and each bound is its bytes at the copy's median bandwidth of the
# same reps, so each % is a same-run ratio of medians; the best-copy figure is printed beside it.
# --lowbit also reports each kernel's regime: its one-thread compute rate on an L3-resident 1M-parameter buffer
# against its bytes bound, so a host where fewer bytes buy nothing (the step is compute-bound) shows it, and each
# kernel's instructions per element on this host's SIMD path (counted by single-stepping, _instcount.py).
# Not for: correctness (tests/test_optim.py, tests/test_optim_lowbit.py).
from __future__ import annotations

import argparse
import datetime
import gc
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from accelerate_c import _C, optim as aopt  # noqa: E402


def gpt2_shapes(n_layer: int = 12, d: int = 768, vocab: int = 50257, ctx: int = 1024) -> list[tuple[int, ...]]:
    shapes = [(vocab, d), (ctx, d)]
    for _ in range(n_layer):
        shapes += [(d,), (d,), (d, 3 * d), (3 * d,), (d, d), (d,), (d,), (d,), (d, 4 * d), (4 * d,), (4 * d, d), (d,)]
    return shapes + [(d,), (d,)]


def make(shapes):
    ps = [torch.nn.Parameter(torch.randn(s) * 0.02) for s in shapes]
    for p in ps:
        p.grad = torch.randn(s if (s := p.shape) else ()) * 1e-3
    return ps


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def bench(named: dict, reps: int, all_times: dict | None = None) -> dict:
    """Interleaved: every rep runs each method once; returns the median seconds per method (and fills all_times
    with every rep's seconds when given)."""
    for f in named.values():  # warm-up (also creates optimizer state)
        f()
    times = {k: [] for k in named}
    for _ in range(reps):
        for k, f in named.items():
            times[k].append(timed(f))
    if all_times is not None:
        all_times.update(times)
    return {k: statistics.median(v) for k, v in times.items()}


def memcpy_bw(nbytes: int, reps: int) -> float:
    """Best-of-reps bandwidth of dst.copy_(src) (STREAM convention: best rep; read + write counted, no
    write-allocate)."""
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    t = min(timed(lambda: dst.copy_(src)) for _ in range(reps))
    del src, dst
    return 2 * nbytes / t


def copy_nbytes(args: argparse.Namespace) -> int:
    return (64 << 20) if args.quick else (1 << 30)


def preamble(args: argparse.Namespace, load: bool = False, copy: bool = True) -> tuple[int, list[str], float]:
    """Repetitions, the header lines (threads, SIMD level, torch; the load average when asked) and, with copy,
    the machine's copy bandwidth measured on its own (best of reps), which the bounds are measured against."""
    reps = args.reps or (3 if args.quick else 7)
    head = (f"threads={torch.get_num_threads()} simd={_C.simd_level()} torch={torch.__version__} reps={reps} "
            "(median, interleaved)")
    lines = [head + (f"; load average at start {os.getloadavg()[0]:.2f}" if load else "")]
    if not copy:
        return reps, lines, 0.0
    bw = memcpy_bw(copy_nbytes(args), reps)
    lines.append(f"memcpy (copy_ of {'64 MiB' if args.quick else '1 GiB'}, best of {reps}): {bw / 1e9:.1f} GB/s")
    return reps, lines, bw


def report(lines: list[str], title: str, n: int, res: dict, ours: str, bpp: int, bw: float) -> None:
    lines.append(f"{title}: {n / 1e6:.1f}M params")
    bound = bpp * n / bw
    for k, t in res.items():
        extra = f"  ours is {t / res[ours]:.2f}x faster" if k != ours else \
            f"  {100 * bound / t:.0f}% of the {bpp} B/param bound ({bound * 1e3:.1f} ms at memcpy bw)"
        lines.append(f"  {k:34s} {t * 1e3:9.2f} ms  {n / t / 1e9:6.3f} Gparam/s{extra}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="small smoke run, nothing appended to RESULTS.md")
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--deepspeed", action="store_true",
                    help="also time DeepSpeedCPUAdam (needs deepspeed importable; its op is JIT-built on first use)")
    ap.add_argument("--no-results", action="store_true", help="do not append to benchmarks/RESULTS.md")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's default)")
    ap.add_argument("--lowbit", action="store_true",
                    help="only the low-precision-state section (8-bit / bf16 state vs torch fused fp32 AdamW, and the "
                         "bitsandbytes / torchao AdamW8bit anchors when importable)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.lowbit:
        return lowbit_main(args)
    reps, lines, bw = preamble(args)
    kw = dict(lr=1e-4, weight_decay=0.01)

    # 1. GPT-2-small parameter list, fp32
    shapes = gpt2_shapes(2, 768, 5000, 256) if args.quick else gpt2_shapes()
    ps = make(shapes)
    n = sum(p.numel() for p in ps)
    ours, tfused = aopt.AdamW(ps, **kw), torch.optim.AdamW(ps, fused=True, **kw)
    named = {"accelerate_c AdamW": ours.step, "torch AdamW(fused=True)": tfused.step}
    if args.deepspeed:
        ds = deepspeed_adam(ps, kw, lines)
        if ds is not None:
            named["DeepSpeedCPUAdam"] = ds.step
    res = bench(named, reps)
    del named
    gc.collect()
    # foreach allocates large temporaries every step; timed on its own so it does not disturb the others
    tforeach = torch.optim.AdamW(ps, foreach=True, **kw)
    res.update(bench({"torch AdamW(foreach=True)": tforeach.step}, max(3, reps // 2)))
    del tforeach
    gc.collect()
    report(lines, f"AdamW step, GPT-2-small parameter list ({len(ps)} tensors)", n, res, "accelerate_c AdamW", 28, bw)

    # 2. mixed precision on the same list: fp32 master + bf16 model copy
    lps = {p: torch.empty_like(p, dtype=torch.bfloat16) for p in ps}
    lp_list, master = list(lps.values()), list(ps)

    def torch_mp():
        tfused.step()
        torch._foreach_copy_(lp_list, master)

    res = bench({"accelerate_c fused_step + bf16 copy": lambda: aopt.fused_step(ours, low_precision_copies=lps),
                 "torch fused AdamW + bf16 copy_": torch_mp}, reps)
    report(lines, "Mixed-precision AdamW step (fp32 master -> bf16 copy), GPT-2-small list", n, res,
           "accelerate_c fused_step + bf16 copy", 30, bw)
    del ours, tfused, ps, lps, lp_list, master
    gc.collect()

    # 3. one flat buffer
    nflat = (8 << 20) if args.quick else (256 << 20)
    p = torch.nn.Parameter(torch.randn(nflat) * 0.02)
    p.grad = torch.randn(nflat) * 1e-3
    m, v = torch.zeros(nflat), torch.zeros(nflat)
    step = [0]

    def flat():
        step[0] += 1
        aopt.adamw_flat_(p.data, p.grad, m, v, step[0], 1e-4, weight_decay=0.01)

    tf = torch.optim.AdamW([p], fused=True, **kw)
    res = bench({"accelerate_c adamw_flat_": flat, "torch AdamW(fused=True)": tf.step}, reps)
    del tf
    gc.collect()
    te = torch.optim.AdamW([p], foreach=True, **kw)
    res.update(bench({"torch AdamW(foreach=True)": te.step}, max(3, reps // 2)))
    del te
    report(lines, "AdamW step, one flat buffer", nflat, res, "accelerate_c adamw_flat_", 28, bw)
    del p, m, v
    gc.collect()

    # 4. the mixed-precision step as training runs it: the bf16 model produced bf16 gradients; the fp32
    # master is updated and written back to the bf16 model. Ours reads the bf16 gradient and writes the bf16
    # copy inside the one pass (2 + 8 + 8 + 8 + 2 = 28 B/param); torch needs an upcast pass, the fused step
    # and a downcast pass (6 + 28 + 6 = 40 B/param).
    master = torch.nn.Parameter(torch.randn(nflat) * 0.02)
    g16 = (torch.randn(nflat) * 1e-3).to(torch.bfloat16)
    model16 = master.detach().to(torch.bfloat16)
    m, v = torch.zeros(nflat), torch.zeros(nflat)
    master.grad = torch.empty(nflat)
    step = [0]

    def ours_mp():
        step[0] += 1
        aopt.adamw_flat_(master.data, g16, m, v, step[0], 1e-4, weight_decay=0.01, low_precision_out=model16)

    tf = torch.optim.AdamW([master], fused=True, **kw)

    def torch_mp16():
        master.grad.copy_(g16)
        tf.step()
        model16.copy_(master.detach())

    res = bench({"accelerate_c adamw_flat_ bf16 in/out": ours_mp, "torch upcast + fused AdamW + downcast": torch_mp16},
                reps)
    report(lines, "Mixed-precision AdamW step (bf16 grads in, fp32 master, bf16 model out), one flat buffer", nflat,
           res, "accelerate_c adamw_flat_ bf16 in/out", 28, bw)
    del master, g16, model16, m, v, tf
    gc.collect()

    text = "\n".join(lines)
    print(text)
    if not args.quick and not args.no_results:
        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "RESULTS.md")
        with open(path, "a") as f:
            f.write(f"\n## optimizer ({datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC})\n\n"
                    f"`{' '.join([os.path.basename(sys.executable)] + sys.argv)}`\n\n```\n{text}\n```\n")


def anchors(ps: list, kw: dict, lines: list[str]) -> dict:
    """bitsandbytes' and torchao's AdamW8bit on the same params, when they import and step on this CPU."""
    out = {}
    def bnb():
        import bitsandbytes
        return bitsandbytes.optim.AdamW8bit(ps, **kw)

    def torchao():
        import torchao.optim
        return torchao.optim.AdamW8bit(ps, **kw)

    for name, make_opt in (("bitsandbytes AdamW8bit", bnb), ("torchao AdamW8bit", torchao)):
        try:
            opt = make_opt()
            opt.step()  # first step: state creation (and torchao's torch.compile)
            out[name] = opt
        except Exception as e:  # not installed, or no CPU path
            lines.append(f"{name} unavailable: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}")
    return out


def tensor_bytes(x: torch.Tensor) -> int:
    """Bytes a state tensor holds; torchao's OptimState8bit subclass keeps them in .codes and .scale."""
    if hasattr(x, "codes") and hasattr(x, "scale"):
        return x.codes.numel() * x.codes.element_size() + x.scale.numel() * x.scale.element_size()
    return x.numel() * x.element_size()


def lowbit_main(args) -> None:
    """Low-precision state on the GPT-2-small parameter list: bytes held, step time against torch's fused fp32
    AdamW, % of each one's own bytes-per-parameter bound, and the 8-bit anchors."""
    from accelerate_c.optim import lowbit

    reps, lines, _ = preamble(args, load=True, copy=False)
    kw = dict(lr=1e-4, weight_decay=0.01)
    shapes = gpt2_shapes(2, 768, 5000, 256) if args.quick else gpt2_shapes()
    ps = make(shapes)
    n = sum(p.numel() for p in ps)
    opts = {"torch AdamW(fused=True) fp32": torch.optim.AdamW(ps, fused=True, **kw),
            "accelerate_c AdamW fp32 state": aopt.AdamW(ps, **kw),
            "accelerate_c AdamW bf16 state": aopt.AdamW(ps, state_dtype=torch.bfloat16, **kw),
            "accelerate_c AdamW 8-bit state": aopt.AdamW(ps, state_dtype="8bit", **kw)}
    opts.update(anchors(ps, kw, lines))
    # DRAM bytes per parameter of one step: grad read 4, param read+write 8, state read+write
    bpp = {"torch AdamW(fused=True) fp32": 28, "accelerate_c AdamW fp32 state": 28, "accelerate_c AdamW bf16 state": 20,
           "accelerate_c AdamW 8-bit state": 16 + 16 / 256}
    # the bandwidth yardstick, timed inside the same interleaved reps as the steps
    nbytes = copy_nbytes(args)
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    copy_name = f"memcpy (copy_ of {'64 MiB' if args.quick else '1 GiB'})"
    named = {copy_name: lambda: dst.copy_(src)}
    named.update({k: o.step for k, o in opts.items()})
    all_times: dict = {}
    res = bench(named, reps, all_times)
    del src, dst
    gc.collect()
    tcopy = res.pop(copy_name)
    bw, bw_best = 2 * nbytes / tcopy, 2 * nbytes / min(all_times[copy_name])
    lines.append(f"{copy_name}, interleaved with the steps: median {bw / 1e9:.1f} GB/s ({tcopy * 1e3:.2f} ms), "
                 f"best {bw_best / 1e9:.1f} GB/s, all reps {' '.join(f'{2 * nbytes / t / 1e9:.0f}' for t in all_times[copy_name])} GB/s")
    lines.append("  each bound: its bytes/param at the median copy bandwidth of these reps (same-run ratio of medians); "
                 "[at the best copy] beside it")
    base = res["torch AdamW(fused=True) fp32"]
    lines.append(f"Adam step, GPT-2-small parameter list ({len(ps)} tensors, {n / 1e6:.1f}M params)")
    for k, t in res.items():
        o = opts[k]
        held = sum(tensor_bytes(x) for st in o.state.values() for key, x in st.items()
                   if torch.is_tensor(x) and key != "step" and not key.startswith("qmap")) / n
        extra = ""
        if k in bpp:
            bound, bound_best = bpp[k] * n / bw, bpp[k] * n / bw_best
            extra = (f"  {100 * bound / t:5.1f}% of its {bpp[k]:.2f} B/param bound ({bound * 1e3:.2f} ms)"
                     f" [{100 * bound_best / t:5.1f}%]")
        lines.append(f"  {k:34s} {t * 1e3:8.2f} ms  {n / t / 1e9:6.3f} Gparam/s  {base / t:5.2f}x torch fused fp32"
                     f"  state {held:5.2f} B/param{extra}")
    lines += regime(kw, bpp, res, n, bw, reps)
    lines += late_steps(opts, reps)
    nb, nn = lowbit.state_nbytes(opts["accelerate_c AdamW 8-bit state"])
    lines.append(f"8-bit state held (lowbit.state_nbytes: codes + block absmax + fp32 state of tensors < 4096): "
                 f"{nb / nn:.3f} B/param; bf16: {lowbit.state_nbytes(opts['accelerate_c AdamW bf16 state'])[0] / n:.3f}"
                 )
    print("\n".join(lines))
    if not args.quick and not args.no_results:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from _results import append_results
        append_results("optimizer.py --lowbit: Adam with bf16 / 8-bit state (GPT-2-small list)",
                       ["```", *lines, "```"])


def regime(kw: dict, bpp: dict, res: dict, n: int, bw: float, reps: int) -> list[str]:
    """Which bound a kernel meets on this host. Its compute rate is measured on ONE thread over one flat 1M-element
    parameter (16 MiB with fp32 state: L3-resident on the hosts seen, so DRAM and TLB misses are rare), 24 steps a
    rep; n / (rate x threads) is then the time the big list's step would take if bytes were free (the threads share
    nothing but the memory system). compute share = that time / the measured time: near 1 (or above: the L3 rate
    is itself a little memory-bound) the step is compute-bound and fewer bytes buy nothing; the best ratio against
    torch fused fp32 it can reach is torch's measured time over its compute time. Well below 1 it waits on memory.
    The copy bound beside it is bytes/param at the memcpy bandwidth of the same reps (memcpy is write-heavy:
    read-heavy steps beat it, see the note above)."""
    threads = torch.get_num_threads()
    ps = make([(1 << 20,)])
    m = ps[0].numel()
    small = {"torch AdamW(fused=True) fp32": torch.optim.AdamW(ps, fused=True, **kw),
             "accelerate_c AdamW fp32 state": aopt.AdamW(ps, **kw),
             "accelerate_c AdamW bf16 state": aopt.AdamW(ps, state_dtype=torch.bfloat16, **kw),
             "accelerate_c AdamW 8-bit state": aopt.AdamW(ps, state_dtype="8bit", **kw)}
    torch.set_num_threads(1)
    try:
        t = bench({k: (lambda o=o: [o.step() for _ in range(24)]) for k, o in small.items()}, reps)
    finally:
        torch.set_num_threads(threads)
    base = res["torch AdamW(fused=True) fp32"]
    out = [f"Regime on this host: each kernel's compute rate on one thread over {m / 1e6:.1f}M params (L3-resident), "
           f"times {threads} threads, against the measured step of the {n / 1e6:.1f}M list"]
    for k, v in t.items():
        rate = 24 * m / v
        tc, tb = n / (rate * threads), bpp[k] * n / bw
        share = tc / res[k]
        which = "compute-bound" if share >= 0.9 else "memory-bound" if share <= 0.75 else "both"
        out.append(f"  {k:34s} {rate / 1e9:6.3f} Gelem/s per thread: compute {tc * 1e3:7.2f} ms of {res[k] * 1e3:7.2f} ms"
                   f" measured (share {share:4.2f}: {which}); copy bound {tb * 1e3:7.2f} ms; at most "
                   f"{base / tc:5.2f}x torch fused fp32 if memory were free")
    out += instruction_counts(t, m)
    return out


LATE_STEP = 20_000  # sqrt(1 - 0.999**t) rounds to 1.0f from t = 16,628 (from 1,656 with beta2 0.99, 325 with 0.95)


def late_steps(opts: dict, reps: int) -> list[str]:
    """The same steps once the second moment's bias correction has rounded to 1 in fp32, as it has for most of a
    long run: our common-call loops then leave its division out (csrc/optim/adam_update.h; the same bits); torch's
    step does not change. Interleaved medians, as above."""
    for o in opts.values():
        for st in o.state.values():
            st["step"] = st["step"].fill_(LATE_STEP) if torch.is_tensor(st["step"]) else LATE_STEP
    res = bench({k: o.step for k, o in opts.items()}, reps)
    base = res["torch AdamW(fused=True) fp32"]
    return [f"Late steps (state step {LATE_STEP}; sqrt(bc2) is 1.0f in fp32 from step 16,628 at beta2 0.999), the "
            f"same list and threads:"] + [f"  {k:34s} {t * 1e3:8.2f} ms  {base / t:5.2f}x torch fused fp32"
                                          for k, t in res.items()]


def instruction_counts(t: dict, m: int) -> list[str]:
    """Instructions per element of each kernel on this host's SIMD path (ptrace single-stepping, _instcount.py), and
    the rate the measured one-thread time implies: what the compute-bound step is made of."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import _instcount

    sizes = (4096, 20480)
    try:
        got = _instcount.per_element(list(_instcount.KINDS.values()), sizes)
    except _instcount.TraceError as e:
        return [f"Instruction counts unavailable: {e}"]
    out = [f"Instructions per element, each kernel on one thread (simd={_C.simd_level()}; counted by single-stepping "
           f"its call at {sizes[0]} and {sizes[1]} elements, benchmarks/_instcount.py), and the instruction rate of "
           f"the compute-rate runs above:"]
    for k, kind in _instcount.KINDS.items():
        c = got[kind]
        ipe = (c[-1] - c[0]) / (sizes[-1] - sizes[0])
        rate = 24 * m / t[k]
        out.append(f"  {k:34s} {ipe:6.2f} instructions/element  x {rate / 1e9:5.3f} Gelem/s = "
                   f"{ipe * rate / 1e9:5.2f} G instructions/s per thread")
    return out


def deepspeed_adam(ps, kw, lines):
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        return DeepSpeedCPUAdam(ps, adamw_mode=True, **kw)
    except Exception as e:  # not installed, or its C++ op could not be JIT-built
        lines.append(f"DeepSpeedCPUAdam unavailable: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
        return None


if __name__ == "__main__":
    main()
