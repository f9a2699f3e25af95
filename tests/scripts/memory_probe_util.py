# tests/scripts/memory_probe_util.py: the resident bytes of the mappings holding given addresses, and the mapping
# holding one address with its VmFlags (/proc/self/smaps), and the resident bytes of an address range
# (/proc/self/pagemap), for tests/scripts/memory_probe.py and tests/test_memory.py.
# Not for: anything else.
import os


def mapping_rss(ptrs: list[int]) -> int:
    """Resident bytes (smaps "Rss") of the mappings holding any of `ptrs`."""
    total, hit = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                a, b = (int(x, 16) for x in head.split("-"))
                hit = any(a <= p < b for p in ptrs)
            elif head == "Rss:" and hit:
                total += int(line.split()[1]) * 1024
    return total


def mapping_of(ptr: int) -> tuple[int, int, list[str]]:
    """(start, end, VmFlags) of the mapping holding `ptr`."""
    found = None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                a, b = (int(x, 16) for x in head.split("-"))
                found = (a, b) if a <= ptr < b else None
            elif head == "VmFlags:" and found:
                return found[0], found[1], line.split()[1:]
    raise LookupError(f"no mapping holds {ptr:#x}")


def range_rss(ptr: int, nbytes: int) -> int:
    """Resident bytes of [ptr, ptr + nbytes) itself, page by page (/proc/self/pagemap's present bit): unlike
    mapping_rss, not swelled by a neighbouring mapping the kernel merged into the same VMA (two anonymous mappings
    with the same flags, e.g. the gradient shard's and the optimizer state's huge-page mappings)."""
    page = os.sysconf("SC_PAGE_SIZE")  # pagemap has one entry per base page
    first, last = ptr // page, (ptr + nbytes - 1) // page
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(first * 8)
        raw = f.read((last - first + 1) * 8)
    present = sum(1 for i in range(0, len(raw), 8) if raw[i + 7] & 0x80)
    return present * page
