# tests/scripts/heap_probe.py: what the C heap keeps of large CPU temporaries after Accelerator() on CPU, for
# tests/test_memory.py: 16 MiB tensors made, filled and freed in turn, each followed by a small long-lived tensor
# (as a step's freed temporaries sit between the blocks it keeps), then the heap's growth (glibc mallinfo2's arena)
# and the process's resident growth, THP_MEM_ALLOC_ENABLE and whether the policy took. Writes JSON to argv[1];
# argv[2] "late": a 4 MiB tensor is made before Accelerator() (torch has then read its huge-page switch: unset).
# Not for: per-strategy figures (benchmarks/memory.py).
import ctypes
import json
import platform
import sys

import torch

from accelerate_c import Accelerator


class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def main() -> None:
    import os
    from accelerate_c.runtime import memory
    early = torch.ones(1 << 20) if sys.argv[2:] == ["late"] else None
    Accelerator(cpu=True)
    out = {"libc": platform.libc_ver()[0], "thp_env": os.environ.get("THP_MEM_ALLOC_ENABLE"),
           "policy": memory._tuned, "early": early is not None}
    if out["libc"] == "glibc":
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = MallInfo2
        keep = []
        heap0, rss0 = libc.mallinfo2().arena, rss()
        for _ in range(8):
            t = torch.ones(4 << 20)  # 16 MiB
            keep.append(torch.ones(64))
            del t
        out.update(heap_growth=libc.mallinfo2().arena - heap0, rss_growth=rss() - rss0)
    with open(sys.argv[1], "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
