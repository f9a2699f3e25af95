# tests/scripts/shm_start.py: the start-up of a job over shared memory, for tests/test_leaks.py under our launcher:
# every rank writes its pid and MASTER_PORT to <out>/rank<r>.json, joins gloo, builds a ShmGroup (where
# ACCELERATE_C_KILL_AT may kill it, or the launcher), all-reduces once and leaves.
# Not for: anything but tests/test_leaks.py.
import json
import os
import sys

import torch
import torch.distributed as dist

out = sys.argv[1]
rank = int(os.environ["RANK"])
with open(os.path.join(out, f"rank{rank}.json"), "w") as fh:
    json.dump({"pid": os.getpid(), "port": os.environ["MASTER_PORT"]}, fh)
dist.init_process_group("gloo")
from accelerate_c.comm.shm import ShmGroup  # noqa: E402 - after the pid is written

g = ShmGroup(None, timeout=60)
t = torch.ones(4)
g.all_reduce(t)
assert t.tolist() == [2.0] * 4
g.close()
dist.destroy_process_group()
