# tests/scripts/sharded_cases.py: several runs in one process (or one launch of N ranks), one after another, so
# that a test pays the interpreter, torch/transformers imports and the launch once per group of cases rather than
# once per case. argv: <cases.json>, a list of {"name", "kind", "argv", "env"}: kind "train" runs sharded_train.py's
# main(argv) (its --emulate / --one_process references too), "pretrained" / "evalmode" / "noinit" the functions of
# construct_checks.py (argv: their arguments). Between cases the process is put back as a fresh one would be: the
# environment restored (the case's "env" and what plugins set: ACCELERATE_USE_FSDP, FSDP_*, ...), accelerate_c's
# AcceleratorState / GradientState reset, the shared-memory groups released (the next case builds its own, reading
# ACCELERATE_C_COMM again); the default process group is kept (sharded_train.KEEP_PG). Each case is announced on
# stdout, so a failure names it.
# Not for: the checks (the tests read what each case wrote).
import gc
import json
import os
import sys

import torch.distributed as dist

import construct_checks
import sharded_train


def reset() -> None:
    from accelerate_c.comm import release_groups
    from accelerate_c.state import AcceleratorState, GradientState
    if dist.is_initialized():
        dist.barrier()  # every rank is done with the groups before they go
        release_groups()
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    gc.collect()


def main() -> None:
    with open(sys.argv[1]) as f:
        cases = json.load(f)
    sharded_train.KEEP_PG = True
    environ = dict(os.environ)
    for case in cases:
        print(f"=== case {case['name']}: {case['kind']} {' '.join(case['argv'])}", flush=True)
        os.environ.update(case.get("env") or {})
        if case["kind"] == "train":
            sharded_train.main(case["argv"])
        else:
            getattr(construct_checks, case["kind"])(*case["argv"])
        os.environ.clear()
        os.environ.update(environ)
        reset()
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
