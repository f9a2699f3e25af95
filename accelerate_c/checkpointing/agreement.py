# accelerate_c/checkpointing/agreement.py: the one collective that makes every rank of a load agree. Each rank
# brings its own outcome (None or the exception it met); one all-gather of a small fixed-size record tells every
# rank which ranks failed and why, so that all of them raise the same CheckpointError (naming the ranks and their
# errors) or all go on. A rank whose own error is not a CheckpointError (a user's hook, HF's RuntimeError for the
# custom objects) re-raises it, the others raise the CheckpointError. One process: the error as it is.
# Not for: what is validated (loading.py) or the transport (accelerate_c.comm.collectives).
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

from .errors import CheckpointError

_RECORD = 2048   # bytes per rank: a flag and the start of the error text


def _record(error: Optional[BaseException]) -> bytes:
    if error is None:
        return b"\x00"
    text = f"{type(error).__name__}: {error}" if not isinstance(error, CheckpointError) else str(error)
    return b"\x01" + text.encode("utf-8", "replace")[: _RECORD - 1]


def _exchange(accelerator: Any, error: Optional[BaseException], world: int) -> list[tuple[int, str]]:
    from accelerate_c.comm.collectives import all_gather_into   # comm is loaded by distributed runs anyway
    raw = _record(error)
    mine = torch.zeros(1, _RECORD, dtype=torch.uint8)
    mine[0, : len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    device = getattr(accelerator, "device", None)
    if device is not None and torch.device(device).type != "cpu":
        mine = mine.to(device)       # NCCL groups gather device tensors
    rows = all_gather_into(mine).cpu()
    failed = []
    for rank in range(world):
        row = bytes(rows[rank].numpy())
        if row[0]:
            failed.append((rank, row[1:].rstrip(b"\x00").decode("utf-8", "replace")))
    return failed


def agree(accelerator: Any, error: Optional[BaseException], what: str,
          outcome: str = "nothing was loaded on any rank") -> None:
    """Collective when the job has several processes: returns when no rank failed, else raises on every rank
    (`outcome`: what the message says the failure left)."""
    world = int(accelerator.num_processes)
    if world <= 1 or not (dist.is_available() and dist.is_initialized()):
        if error is not None:
            raise error
        return
    failed = _exchange(accelerator, error, world)
    if not failed:
        return
    by_text: dict[str, list[int]] = {}
    for rank, text in failed:
        by_text.setdefault(text, []).append(rank)
    parts = [f"rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}: {t}" for t, r in by_text.items()]
    message = f"{what} failed on {len(failed)} of {world} ranks ({outcome}): " + "; ".join(parts)
    if error is not None and not isinstance(error, CheckpointError):
        raise error
    raise CheckpointError(message) from error
