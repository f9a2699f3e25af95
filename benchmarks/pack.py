# benchmarks/pack.py: the sharded engine's copy-in (C kernel _C.pack, csrc/ops/pack.c) against the torch copies
# it replaces (FlatUnit.pack before: zero_/copy_ per tensor plus the padding), on the gradients of one transformer
# block (many tensors, biases included) and of a big unit, for the dtype pairs the engine uses: bf16 -> bf16
# (param_dtype = reduce_dtype), bf16 -> fp32 (reduce_dtype fp32), fp32 -> fp32. Interleaved rounds, medians.
# Not for: correctness (tests/test_shard_kernels.py) or the whole step (benchmarks/zero_step.py).
# Usage: python benchmarks/pack.py [--quick] [--reps 15] [--threads T] [--no-record]
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)
from accelerate_c import _C  # noqa: E402
from _results import append_results  # noqa: E402


def block_shapes(d: int) -> list[tuple[int, ...]]:
    """A GPT block's parameters (LN, fused qkv, proj, MLP; weights and biases), registration order."""
    return [(d,), (d,), (3 * d, d), (3 * d,), (d, d), (d,), (d,), (d,), (4 * d, d), (4 * d,), (d, 4 * d), (d,)]


def torch_pack(out: torch.Tensor, offsets: list[int], tensors: list[torch.Tensor], numel: int) -> None:
    for off, t in zip(offsets, tensors):
        out[off:off + t.numel()].copy_(t.reshape(-1))
    out[numel:].zero_()


def case(shapes, src_dtype, dst_dtype, world: int = 2):
    tensors = [torch.randn(s).to(src_dtype) for s in shapes]
    offsets, off = [], 0
    for t in tensors:
        offsets.append(off)
        off += t.numel()
    padded = -(-(off + 1) // world) * world  # at least one padding element
    return tensors, offsets, off, torch.empty(padded, dtype=dst_dtype)


def timed(fns: dict, reps: int) -> dict:
    ts = {k: [] for k in fns}
    for r in range(reps + 1):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            if r:
                ts[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in ts.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description="C pack kernel vs torch copies")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-record", action="store_true")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    nthreads = torch.get_num_threads()
    units = {"GPT block d=512 (3.1M, 12 tensors)": block_shapes(512),
             "big unit (8 x 4M)": [(2048, 2048)] * 8}
    if args.quick:
        units = {"GPT block d=128": block_shapes(128)}
        args.reps = 3
    pairs = [(torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32), (torch.float32, torch.float32)]
    lines = [f"torch {torch.__version__}, {nthreads} thread(s) (torch.get_num_threads(), also the kernel's), median of "
             f"{args.reps} interleaved rounds.", "",
             "| unit | src -> dst | torch copies ms | C pack ms | torch / C |", "|---|---|---|---|---|"]
    for name, shapes in units.items():
        for sd, dd in pairs:
            tensors, offsets, numel, out = case(shapes, sd, dd)
            ref = out.clone()
            torch_pack(ref, offsets, tensors, numel)
            _C.pack(out, tensors, offsets, nthreads)
            assert torch.equal(out.view(torch.uint8), ref.view(torch.uint8)), (name, sd, dd)
            med = timed({"torch": lambda: torch_pack(out, offsets, tensors, numel),
                         "c": lambda: _C.pack(out, tensors, offsets, nthreads)}, args.reps)
            lines.append(f"| {name} | {str(sd)[6:]} -> {str(dd)[6:]} | {med['torch'] * 1e3:.3f} | {med['c'] * 1e3:.3f} | "
                         f"{med['torch'] / med['c']:.2f}x |")
    print("\n".join(lines))
    if not args.no_record and not args.quick:
        append_results("Sharded copy-in: C pack kernel vs torch copies (benchmarks/pack.py)", lines)


if __name__ == "__main__":
    main()
