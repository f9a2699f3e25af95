# benchmarks/cast.py: accelerate_c.ops.cast against torch's own sequences on big (>= 1 GiB fp32) arrays, with a
# memcpy of the same array measured in the same run as the bandwidth yardstick.
# Not for: correctness (tests/test_ops_cast.py) or small-tensor latency.
#
# Rows: fp32 -> float8_e4m3fn with scale + amax (torch: (x*s).clamp(-448,448).to(e4m3) plus x.abs().max()),
# fp32 -> bf16 and bf16 -> fp32 (torch: Tensor.to). "ours" is the public API (allocates its output, like
# torch); "ours/out" is ops.cast(..., out=) into a preallocated output (comparable with the memcpy, which also
# writes into a preallocated buffer; a fresh allocation costs page faults, ~1 GB/s on the 2-core VM). Bytes are counted as reads + writes without write-allocate:
# 5 B/el fp32->fp8, 6 B/el fp32<->bf16, 8 B/el memcpy. Median (and best) of --reps repetitions.
# Usage: python benchmarks/cast.py [--quick] [--reps 5] [--elems N] [--threads T] [--no-record]
#   default: 256 Mi elements (1 GiB of fp32, ~4x the 260 MiB L3), appends a block to benchmarks/RESULTS.md.
#   --quick: 4 Mi elements, prints only (smoke test).
import argparse
import datetime
import os
import shlex
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from accelerate_c import _C, ops  # noqa: E402

E4M3 = torch.float8_e4m3fn


def run_interleaved(fns: dict, reps: int) -> dict:
    """Times every callable once per round, rounds repeated reps+1 times (the first is a warm-up), so the
    noise of a shared box hits all of them alike (A/B interleaving). Each timed call follows an untimed call
    of the same callable, so it finds the allocator as it left it (otherwise whoever allocates first after
    another op's big temporaries were trimmed pays the page faults). Returns {name: (median, best)} in s."""
    ts = {k: [] for k in fns}
    for r in range(reps + 1):
        for k, fn in fns.items():
            fn()
            t0 = time.perf_counter()
            fn()
            if r:
                ts[k].append(time.perf_counter() - t0)
    return {k: (statistics.median(v), min(v)) for k, v in ts.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="small arrays, no RESULTS.md entry")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--elems", type=int, default=None, help="elements per array (default 256 Mi, quick 4 Mi)")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    ap.add_argument("--no-record", action="store_true", help="do not append to benchmarks/RESULTS.md")
    args = ap.parse_args()
    n = args.elems or ((4 << 20) if args.quick else (256 << 20))
    reps = max(args.reps, 5)
    if args.threads:
        torch.set_num_threads(args.threads)
    nthreads = torch.get_num_threads()

    x = torch.randn(n) * 100
    xb = x.to(torch.bfloat16)
    buf32 = torch.empty(n)  # memcpy destination, and the preallocated fp32 output
    out8 = torch.empty(n, dtype=E4M3)
    out16 = torch.empty(n, dtype=torch.bfloat16)
    scale = torch.tensor(448.0) / x.abs().max()
    for t in (buf32, out8, out16):
        t.zero_()

    def torch_fp8():
        y = (x.float() * scale).clamp(-448.0, 448.0).to(E4M3)
        return y, x.abs().max()

    t = run_interleaved({
        "memcpy": lambda: buf32.copy_(x),
        # glibc memcpy (non-temporal stores for big copies) on the same threads: f32 -> f32 without a scale is
        # a plain copy in the C kernel
        "gmemcpy": lambda: _C.cast(x, buf32, None, None, nthreads),
        "fp8": lambda: ops.cast(x, E4M3, scale=scale, return_amax=True),
        "fp8/out": lambda: ops.cast(x, E4M3, scale=scale, return_amax=True, out=out8),
        "fp8/torch": torch_fp8,
        "bf16": lambda: ops.cast(x, torch.bfloat16),
        "bf16/out": lambda: ops.cast(x, torch.bfloat16, out=out16),
        "bf16/torch": lambda: x.to(torch.bfloat16),
        "bf16/torch_out": lambda: out16.copy_(x),
        "f32": lambda: ops.cast(xb, torch.float32),
        "f32/out": lambda: ops.cast(xb, torch.float32, out=buf32),
        "f32/torch": lambda: xb.to(torch.float32),
        "f32/torch_out": lambda: buf32.copy_(xb),
    }, reps)
    rows = [("fp32->e4m3 scale+amax", 5, t["fp8"], t["fp8/out"], t["fp8/torch"]),  # (name, B/el, ours, ours/out, torch)
            ("fp32->bf16", 6, t["bf16"], t["bf16/out"], t["bf16/torch"]),
            ("bf16->fp32", 6, t["f32"], t["f32/out"], t["f32/torch"])]
    mc, gmc = t["memcpy"], t["gmemcpy"]
    torch_out = (t["bf16/torch_out"], t["f32/torch_out"])
    memcpy_bw = max(8 * n / mc[0], 8 * n / gmc[0]) / 1e9

    lines = [f"n={n} elements ({4 * n / 2**30:.2f} GiB fp32), threads={nthreads}, simd={_C.simd_level()}, "
             f"torch {torch.__version__}, reps={reps} interleaved (median; best in brackets)",
             f"memcpy (copy_ into preallocated fp32, 8 B/el): {mc[0]*1e3:.1f} ms -> {8 * n / mc[0] / 1e9:.1f} GB/s; glibc memcpy {gmc[0]*1e3:.1f} ms -> {8 * n / gmc[0] / 1e9:.1f} GB/s",
             f"% memcpy below is against the faster of the two: {memcpy_bw:.1f} GB/s",
             "",
             "| cast | ours ms | ours GB/s | ours/out ms | ours/out GB/s | % memcpy | torch ms | torch GB/s | torch/ours |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, bpe, ours, ours_out, tt in rows:
        gb = lambda t: bpe * n / t / 1e9  # noqa: E731
        lines.append(f"| {name} | {ours[0]*1e3:.1f} [{ours[1]*1e3:.1f}] | {gb(ours[0]):.1f} | "
                     f"{ours_out[0]*1e3:.1f} [{ours_out[1]*1e3:.1f}] | {gb(ours_out[0]):.1f} | "
                     f"{100 * gb(ours_out[0]) / memcpy_bw:.0f} % | {tt[0]*1e3:.1f} [{tt[1]*1e3:.1f}] | "
                     f"{gb(tt[0]):.1f} | {tt[0] / ours[0]:.2f}x |")
    lines.append(f"(torch into preallocated outputs, copy_: fp32->bf16 {torch_out[0][0]*1e3:.1f} ms = "
                 f"{6 * n / torch_out[0][0] / 1e9:.1f} GB/s, bf16->fp32 {torch_out[1][0]*1e3:.1f} ms = "
                 f"{6 * n / torch_out[1][0] / 1e9:.1f} GB/s)")
    print("\n".join(lines))
    if args.quick or args.no_record:
        return
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "RESULTS.md")
    cmd = " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv])
    with open(path, "a") as f:
        f.write(f"\n## cast ({datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC})\n\n`{cmd}`\n\n")
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
