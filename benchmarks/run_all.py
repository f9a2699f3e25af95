# benchmarks/run_all.py: `make bench`: runs every benchmark in turn (each prints ours, the baseline and the
# ratio, and appends its block to benchmarks/RESULTS.md). Run nothing else meanwhile: timings are
# wall-clock on a shared 2-core machine. Pass --quick for a smoke run that records nothing.
# The benchmarks that train in bf16 run our CPU bf16 kernels (precision/cpu_bf16.py) where the CPU has no native
# bf16 matmuls; trainer_step.py's HF run and first floor use torch's there, tens of times slower (about 15 of its
# minutes on a 2-core AVX2 host).
# Not for: pass/fail (no thresholds are enforced here; RESULTS.md is read by people).
from __future__ import annotations

import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
BENCHMARKS = [["overhead.py"], ["allreduce.py"], ["everyday.py"], ["ddp_step.py"], ["optimizer.py"],
              ["optimizer.py", "--lowbit"], ["cast.py"], ["convergence.py"], ["cpu_bf16.py"], ["convergence.py", "--optim"],
              ["checkpoint.py"], ["zero_step.py"], ["zero_step.py", "--bf16"], ["pack.py"], ["sharded_init.py"],
              ["memory.py"], ["memory.py", "--nproc", "3", "--kinds", "torch_ddp,torch_fsdp2_trim,z3"], ["tp_step.py"],
              ["pp_step.py"], ["bigmodel_offload.py", "--hidden", "1536", "--layers", "12"], ["trainer_step.py"]]
# where the CPU has native bf16 matmuls only (elsewhere torch emulates them: about an hour here)
NATIVE_BF16 = [["bigmodel_offload.py", "--hidden", "2048", "--layers", "12", "--dtype", "bfloat16"]]


def _native_bf16() -> bool:
    sys.path.insert(0, os.path.dirname(HERE))
    from accelerate_c.precision.policy import cpu_has_native_bf16

    return cpu_has_native_bf16()


def main() -> int:
    extra = sys.argv[1:]
    failed = []
    for name, *args in BENCHMARKS + (NATIVE_BF16 if _native_bf16() else []):
        path = os.path.join(HERE, name)
        if not os.path.exists(path):
            continue
        title = " ".join([name, *args])
        print(f"\n===== {title} =====", flush=True)
        rc = subprocess.call([sys.executable, path, *args, *extra])
        if rc != 0:
            failed.append(title)
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
