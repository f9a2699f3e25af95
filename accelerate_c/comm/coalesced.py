# accelerate_c/comm/coalesced.py: broadcast_coalesced: many tensors of any dtype copied from one rank to all,
# packed as raw bytes into a few flat buffers (one collective per chunk instead of one per tensor).
# Not for: choosing the collective (the caller passes its group's broadcast).
from __future__ import annotations

from typing import Any, Callable

import torch

BROADCAST_CHUNK_BYTES = 64 << 20  # coalesced broadcasts go in pieces of at most this (bounded extra memory)


@torch.no_grad()
def broadcast_coalesced(tensors: list[torch.Tensor], broadcast: Callable[[torch.Tensor], Any],
                        chunk_bytes: int = BROADCAST_CHUNK_BYTES) -> None:
    """Copies the src rank's `tensors` into every rank's in place, packed as raw bytes into few flat buffers
    (one collective per chunk instead of one per tensor; any dtype). `broadcast(flat_uint8)` is the collective."""
    pending: list[torch.Tensor] = []
    size = 0

    def flush() -> None:
        nonlocal pending, size
        if not pending:
            return
        offsets, off = [], 0
        for t in pending:  # each tensor at a 16-byte aligned offset, so its bytes view back as its dtype
            offsets.append(off)
            off += -(-t.numel() * t.element_size() // 16) * 16
        flat = torch.empty(off, dtype=torch.uint8, device=pending[0].device)
        for t, o in zip(pending, offsets):
            flat[o:o + t.numel() * t.element_size()].copy_(t.contiguous().view(-1).view(torch.uint8))
        broadcast(flat)
        for t, o in zip(pending, offsets):
            t.copy_(flat[o:o + t.numel() * t.element_size()].view(t.dtype).view(t.shape))
        pending, size = [], 0

    for t in tensors:
        if t.numel() == 0:
            continue
        nbytes = t.numel() * t.element_size()
        if pending and (size + nbytes > chunk_bytes or pending[0].device != t.device):
            flush()
        pending.append(t.data)
        size += nbytes
    flush()
