# benchmarks/run_all.py: `make bench`: runs every benchmark in turn (each prints ours, the baseline and the
# ratio, and appends its block to benchmarks/RESULTS.md). Run nothing else meanwhile: timings are
# wall-clock on a shared 2-core machine. Pass --quick for a smoke run that records nothing.
# The benchmarks that train in bf16 (BF16) are skipped, with the reason printed, on a CPU whose bf16 matmuls torch
# emulates (no AVX512-BF16 / AMX: tens of times slower than fp32, they do not finish in useful time); --all runs them.
# Not for: pass/fail (no thresholds are enforced here; RESULTS.md is read by people).
from __future__ import annotations

import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
BENCHMARKS = [["overhead.py"], ["allreduce.py"], ["everyday.py"], ["ddp_step.py"], ["optimizer.py"],
              ["optimizer.py", "--lowbit"], ["cast.py"], ["convergence.py"], ["convergence.py", "--optim"],
              ["checkpoint.py"], ["zero_step.py"], ["zero_step.py", "--bf16"], ["pack.py"], ["sharded_init.py"],
              ["memory.py"], ["memory.py", "--nproc", "3", "--kinds", "torch_ddp,torch_fsdp2_trim,z3"], ["tp_step.py"],
              ["pp_step.py"], ["bigmodel_offload.py", "--hidden", "1536", "--layers", "12"], ["trainer_step.py"]]
BF16 = [["convergence.py"], ["zero_step.py", "--bf16"], ["trainer_step.py"]]


def native_bf16() -> bool:
    sys.path.insert(0, os.path.dirname(HERE))
    from accelerate_c.precision.policy import cpu_has_native_bf16
    return cpu_has_native_bf16()


def main() -> int:
    extra = [a for a in sys.argv[1:] if a != "--all"]
    skip_bf16 = "--all" not in sys.argv[1:] and not native_bf16()
    failed, skipped = [], []
    for name, *args in BENCHMARKS:
        path = os.path.join(HERE, name)
        if not os.path.exists(path):
            continue
        title = " ".join([name, *args])
        print(f"\n===== {title} =====", flush=True)
        if skip_bf16 and [name, *args] in BF16:
            print("skipped: it trains in bf16, whose matmuls torch emulates on this CPU (no AVX512-BF16 / AMX); run it "
                  f"by hand (python benchmarks/{title}), or all of them with benchmarks/run_all.py --all", flush=True)
            skipped.append(title)
            continue
        rc = subprocess.call([sys.executable, path, *args, *extra])
        if rc != 0:
            failed.append(title)
    if skipped:
        print(f"skipped (bf16 emulated here): {', '.join(skipped)}")
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
