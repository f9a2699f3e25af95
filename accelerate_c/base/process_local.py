# accelerate_c/base/process_local.py: pickling of objects that hold a live resource of this process (a torch process
# group, a shared-memory segment and its threads). Such an object pickles as a reference to itself: unpickled in the
# process that pickled it (or in a child forked from it) the reference resolves to the same live object, the way
# torch's DistributedDataParallel re-attaches the default process group when it is unpickled; anywhere else it
# fails with an error that names the object and the process that owned it. This is what makes an Accelerator of a
# distributed run picklable, as HF's is (the Accelerator: csrc/accel_type.c's __getstate__, facade/accelerator.py).
# Not for: objects without live resources (they pickle by value, as usual).
from __future__ import annotations

import itertools
import os
import pickle
import weakref
from typing import Any

_LIVE: "weakref.WeakValueDictionary[int, Any]" = weakref.WeakValueDictionary()
_TOKENS = itertools.count(1)


class ProcessLocal:
    """Mixin: `pickle` writes a reference to this live object instead of its fields (see the module header)."""

    def __reduce_ex__(self, protocol: int) -> Any:
        token = self.__dict__.get("_process_local_token")
        if token is None:
            token = next(_TOKENS)
            self.__dict__["_process_local_token"] = token
        _LIVE[token] = self
        return _resolve, (token, type(self).__qualname__, os.getpid())


def _resolve(token: int, kind: str, pid: int) -> Any:
    obj = _LIVE.get(token)
    if obj is None or type(obj).__qualname__ != kind:
        raise pickle.UnpicklingError(
            f"accelerate_c: this pickle refers to a live {kind} (a process group or shared-memory segment of a "
            f"distributed run) of process {pid}; it can be unpickled only in that process or a child forked from "
            f"it while the object still exists (this is process {os.getpid()}). Save state with "
            "accelerator.save_state / save_model to move a run between processes.")
    return obj


class ProcessBound:
    """Mixin for the gradient machinery of a prepared model (its buffers, hooks and counters belong to this
    process's run): pickle and copy.deepcopy refuse it with an error that says what to do instead."""

    def __reduce_ex__(self, protocol: int) -> Any:
        raise TypeError(
            f"accelerate_c: a model prepared for data parallelism or sharding ({type(self).__name__}: its gradient "
            "buffers and hooks belong to this process's run) cannot be pickled or deep-copied; pickle or copy "
            "accelerator.unwrap_model(model) instead, or use accelerator.save_state / save_model")
