# accelerate_c/data/resume.py: the data-position bookkeeping every prepared loader shares (beyond HF):
# epoch (`iteration`), batches yielded in the epoch, and the RNG snapshot needed to replay the epoch's
# order, exposed as state_dict()/load_state_dict() made only of JSON-able values and CPU tensors.
#
# Why a snapshot at the START of the epoch: a shuffling sampler draws its permutation from its generator
# (and, when it has none, from the global torch RNG; torch's DataLoader iterator also draws one base seed)
# as the epoch begins. Resuming mid-epoch therefore restores those states, re-runs the sampler (cheaply,
# indices only) and drops the batches already seen; the global torch RNG is put back afterwards so the
# training RNG restored by load_state is untouched. Randomness inside Dataset.__getitem__ is not replayed.
# Also the DataLoaderStateMixin (end_of_dataloader/remainder/GradientState registration) of HF.
# Not for: sharding (samplers.py) or the iteration loops (loaders.py).
from __future__ import annotations

import warnings
import weakref
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch
from torch.utils.data import BatchSampler

from .samplers import SeedableRandomSampler, SkipBatchSampler

FORMAT = "accelerate_c.dataloader/1"


def get_sampler(dataloader: Any) -> Any:
    """The sampler of a loader (HF semantics: the `.sampler` of its batch sampler)."""
    if isinstance(dataloader.sampler, BatchSampler):
        return getattr(dataloader.sampler, "sampler", None)
    return getattr(dataloader.batch_sampler, "sampler", None)


def _deep_sampler(dataloader: Any) -> Any:
    """The innermost index sampler, looking through BatchSamplerShard/SkipBatchSampler wrappers."""
    obj = dataloader.sampler if isinstance(dataloader.sampler, BatchSampler) else dataloader.batch_sampler
    for _ in range(8):
        if obj is None:
            return None
        if hasattr(obj, "sampler"):
            return obj.sampler
        obj = getattr(obj, "batch_sampler", None)
    return None


class DataLoaderStateMixin:
    """end_of_dataloader / remainder bookkeeping and registration with GradientState (HF's mixin)."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.end_of_dataloader = False
        cls.remainder = -1

    def reset(self) -> None:
        self.end_of_dataloader = False
        self.remainder = -1

    def begin(self) -> None:
        self.reset()
        with suppress(Exception):
            if not self._drop_last:
                length = getattr(self.dataset, "total_dataset_length", len(self.dataset))
                self.remainder = length % self.total_batch_size
        self.gradient_state._add_dataloader(self)

    def end(self) -> None:
        self.gradient_state._remove_dataloader(self)


@dataclass
class _Resume:
    skip: int  # batches of the epoch (loader units) already consumed
    rng: dict  # role -> generator state to install at the epoch start
    torch_rng: Optional[torch.Tensor]  # global CPU RNG state at the epoch start


class ResumableMixin:
    """state_dict()/load_state_dict() for prepared loaders. Subclasses call _start_epoch() at the top of
    __iter__, bump self._position for every batch of the epoch (skipped ones included) and call
    _finish_epoch() after the last one."""

    _resume: Optional[_Resume] = None
    _epoch_start: Optional[dict] = None
    _position = 0
    _in_epoch = False
    _parent_ref: Any = None
    _child_ref: Any = None

    # -- pickling: links to other loaders and the process-wide singletons are not part of a loader ----
    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        for key in ("_parent_ref", "_child_ref", "gradient_state", "state", "_iterator"):
            state.pop(key, None)
        return state

    def __setstate__(self, state: dict) -> None:
        from ..runtime.state import GradientState, PartialState

        self.__dict__.update(state)
        self.__dict__["_iterator"] = None
        self.__dict__["gradient_state"] = GradientState()
        if "split_batches" in state:  # DataLoaderDispatcher
            self.__dict__["state"] = PartialState()

    # -- generators -----------------------------------------------------------------------------------
    def _generators(self) -> dict:
        sampler = _deep_sampler(self)
        inner_ds = getattr(self.dataset, "dataset", None)
        candidates = [("synchronized", getattr(self, "synchronized_generator", None)),
                      ("loader", getattr(self, "generator", None)),
                      ("sampler", getattr(sampler, "generator", None)),
                      ("dataset", getattr(self.dataset, "generator", None)),
                      ("inner_dataset", getattr(inner_ds, "generator", None))]
        out, seen = {}, set()
        for role, gen in candidates:
            if isinstance(gen, torch.Generator) and id(gen) not in seen:
                seen.add(id(gen))
                out[role] = gen
        return out

    def _rng_states(self) -> dict:
        return {role: g.get_state() for role, g in self._generators().items()}

    def _install_rng(self, states: dict) -> None:
        gens = self._generators()
        for role, state in states.items():
            if role in gens:
                gens[role].set_state(state.clone() if isinstance(state, torch.Tensor) else torch.tensor(state))

    def _sampler_offset(self) -> int:
        """Batches (loader units) a SkipBatchSampler made by skip_first_batches drops every epoch."""
        bs = self.sampler if isinstance(self.sampler, BatchSampler) else self.batch_sampler
        return bs.skip_batches // self._sampler_units() if isinstance(bs, SkipBatchSampler) else 0

    def _sampler_units(self) -> int:
        return 1

    # -- epoch protocol ---------------------------------------------------------------------------------
    def _start_epoch(self, resume: Optional[_Resume]) -> None:
        if resume is not None:
            self._install_rng(resume.rng)
        torch_rng = resume.torch_rng if resume is not None and resume.torch_rng is not None else torch.get_rng_state()
        self._epoch_start = {"rng": self._rng_states(), "torch_rng": torch_rng}
        self._in_epoch = True

    @contextmanager
    def _epoch_start_rng(self, resume: Optional[_Resume]) -> Iterator[None]:
        """While creating the iterator of a resumed epoch, the global RNG is the epoch-start one."""
        if resume is None or resume.torch_rng is None:
            yield
            return
        saved = torch.get_rng_state()
        torch.set_rng_state(resume.torch_rng)
        try:
            yield
        finally:
            torch.set_rng_state(saved)

    def _finish_epoch(self) -> None:
        self.iteration += 1
        self._in_epoch = False
        parent = self._parent_ref() if self._parent_ref is not None else None
        if parent is not None:
            parent.iteration = self.iteration
            parent._in_epoch = False

    def _take_resume(self) -> Optional[_Resume]:
        resume, self._resume = self._resume, None
        return resume

    # -- public API -------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The data position: epoch, batches yielded in it, and the RNG states that replay its order."""
        child = self._child_ref() if self._child_ref is not None else None
        if child is not None and child._in_epoch:
            return child.state_dict()
        sd: dict = {"format": FORMAT, "iteration": int(self.iteration)}
        if self._resume is not None:  # loaded but not iterated yet: report what was loaded
            sd.update(mid_epoch=True, batches_yielded=self._resume.skip,
                      rng={k: v.clone() for k, v in self._resume.rng.items()}, torch_rng=self._resume.torch_rng)
        elif self._in_epoch and not self.end_of_dataloader:
            sd.update(mid_epoch=True, batches_yielded=int(self._position),
                      rng={k: v.clone() for k, v in self._epoch_start["rng"].items()},
                      torch_rng=self._epoch_start["torch_rng"].clone())
        else:  # between epochs (or holding the last batch): the next epoch starts from the current states
            sd.update(mid_epoch=False, batches_yielded=0, rng=self._rng_states(), torch_rng=None,
                      iteration=int(self.iteration) + (1 if self._in_epoch else 0))
        sampler = _deep_sampler(self)
        sd["sampler"] = ({"initial_seed": int(sampler.initial_seed), "epoch": int(sampler.epoch)}
                         if isinstance(sampler, SeedableRandomSampler) else None)
        # the names the checkpoint index records as the data position
        sd["epoch"], sd["batches_consumed"] = int(sd["iteration"]), int(sd["batches_yielded"])
        sd["samples_consumed"] = int(sd["batches_yielded"]) * int(getattr(self, "total_batch_size", 0) or 0)
        sd["num_processes"] = int(getattr(self, "_num_processes_for_state", 1))
        sd["process_index"] = int(getattr(self, "_process_index_for_state", 0))
        return sd

    def load_state_dict(self, state_dict: dict, resume_position: bool = True) -> None:
        """Restore a position saved by state_dict(). The next __iter__ resumes at the next batch of the same
        epoch order (resume_position=False: replays that epoch from its first batch, e.g. for
        skip_first_batches). Later epochs continue as in an uninterrupted run."""
        if state_dict.get("format") != FORMAT:
            raise ValueError(f"not an accelerate_c dataloader state (format={state_dict.get('format')!r})")
        saved_n = state_dict.get("num_processes")
        now_n = int(getattr(self, "_num_processes_for_state", 1))
        if saved_n is not None and int(saved_n) != now_n and state_dict.get("mid_epoch"):
            warnings.warn(f"Resuming a dataloader position saved with {saved_n} processes on {now_n}: the epoch and "
                          "the number of batches already consumed are restored, but the per-process batch order "
                          "of this epoch differs from the interrupted run.", UserWarning, stacklevel=2)
        self.iteration = int(state_dict["iteration"])
        info = state_dict.get("sampler")
        sampler = _deep_sampler(self)
        if info is not None and isinstance(sampler, SeedableRandomSampler):
            sampler.initial_seed = int(info["initial_seed"])
            sampler.epoch = int(info["epoch"])
        rng = {k: (v if isinstance(v, torch.Tensor) else torch.tensor(v, dtype=torch.uint8))
               for k, v in state_dict.get("rng", {}).items()}
        self._install_rng(rng)
        self._in_epoch = False
        if state_dict.get("mid_epoch"):
            torch_rng = state_dict.get("torch_rng")
            if torch_rng is not None and not isinstance(torch_rng, torch.Tensor):
                torch_rng = torch.tensor(torch_rng, dtype=torch.uint8)
            skip = int(state_dict["batches_yielded"]) if resume_position else 0
            self._resume = _Resume(skip=skip, rng=rng, torch_rng=torch_rng)
        else:
            self._resume = None

    def _adopt(self, parent: Any, num_batches: int) -> None:
        """Link a skip_first_batches loader to the loader it was made from: it takes over a pending
        resume's RNG snapshot (so the skipped epoch is the saved one) and reports progress back."""
        self._parent_ref = weakref.ref(parent)
        parent._child_ref = weakref.ref(self)
        pending = parent._take_resume() if isinstance(parent, ResumableMixin) else None
        if pending is not None:
            self._resume = _Resume(skip=0, rng=pending.rng, torch_rng=pending.torch_rng)
