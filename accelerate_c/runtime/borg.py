# accelerate_c/runtime/borg.py: pickling of the process-wide state objects (PartialState, AcceleratorState,
# GradientState: every instance shares its class's `_shared_state`). A pickled state is a view of its process's
# state: unpickled where that state exists (the same process, a forked child, or any process that built an
# Accelerator) the object shares the live state, as a freshly made instance would; unpickled where it was never
# made, the pickled values become the process's state, as unpickling HF's state objects gives. Entries that are
# only meaningful in their own process (weak references to the Accelerator and to the dataloaders) are not pickled.
# Not for: the Accelerator itself (csrc/accel_type.c, facade/accelerator.py) or live process groups
# (base/process_local.py).
from __future__ import annotations

from typing import Any

_PROCESS_ONLY = {"_owner_ref": None, "_dataloader_references_ref": [None]}


def reduce_shared(obj: Any, *also: type) -> tuple:
    """`__reduce__` of a shared-state object: its class, a snapshot of its state, and the snapshots of the
    shared states it builds on (`also`: AcceleratorState's copy of PartialState's)."""
    snaps = [(cls, _snapshot(cls._shared_state)) for cls in (type(obj), *also)]
    return _restore_shared, (snaps,)


def _snapshot(state: dict) -> dict:
    return {k: (_PROCESS_ONLY[k] if k in _PROCESS_ONLY else v) for k, v in state.items()}


def _restore_shared(snaps: list) -> Any:
    (cls, snap), bases = snaps[0], snaps[1:]
    for base, base_snap in bases:
        if not base._shared_state:
            base._shared_state.update(base_snap)
    if not cls._shared_state:
        cls._shared_state.update(snap)
        for base, _ in bases:  # the process's own values win (a PartialState made here before unpickling)
            cls._shared_state.update(base._shared_state)
    obj = cls.__new__(cls)
    obj.__dict__ = cls._shared_state
    return obj
