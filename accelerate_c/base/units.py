# accelerate_c/base/units.py: HF's rendering of a byte count (`accelerate.utils.convert_bytes`, also the tables of
# `estimate-memory`): the largest 1024-based unit that keeps the value below 1024, rounded to two decimals.
# Not for: parsing sizes ("10GB" -> bytes: bigmodel's convert_file_size_to_int).
from __future__ import annotations


def convert_bytes(size: float) -> str:
    """`size` bytes as HF writes it: "12 bytes", "1.5 KB", "3.5 TB"."""
    for unit in ("bytes", "KB", "MB", "GB", "TB"):
        if size < 1024.0:
            return f"{round(size, 2)} {unit}"
        size /= 1024.0
    return f"{round(size, 2)} PB"
