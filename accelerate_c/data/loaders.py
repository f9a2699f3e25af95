# accelerate_c/data/loaders.py: the DataLoader subclasses a prepared dataloader is made of, with HF's
# iteration semantics: DataLoaderShard (each process loads its own shard; RNG sync at each epoch start,
# set_epoch(iteration), one-batch prefetch so end_of_dataloader is set on the last batch, device move),
# DataLoaderDispatcher (process 0 loads, broadcasts, every process keeps its slice) and SkipDataLoader.
# They subclass torch's DataLoader directly (so isinstance(dl, DataLoader) holds) and carry the
# state_dict/load_state_dict of data/resume.py.
# Not for: deciding how to shard (data/prepare.py) or the samplers (data/samplers.py).
from __future__ import annotations

import math
from typing import Any, Callable, Iterator, Optional

from torch.utils.data import BatchSampler, DataLoader, IterableDataset

from ..runtime.state import GradientState, PartialState
from ..runtime.operations import (broadcast, broadcast_object_list, concatenate, find_batch_size, get_data_structure,
                                  initialize_tensors, send_to_device, slice_tensors)
from ..runtime.random import synchronize_rng_states
from .resume import DataLoaderStateMixin, ResumableMixin, _Resume, get_sampler
from .samplers import _ResumeSkip


class _SkippableIndexSampler:
    """Mixin overriding DataLoader._index_sampler so a resumed epoch drops its first batches at the index
    level (the data of skipped batches is never loaded); also the epoch start both loaders share."""

    _skip_pending = (0, 0)

    @property
    def _index_sampler(self) -> Any:
        base = self.batch_sampler if self._auto_collation else self.sampler
        return _ResumeSkip(base, *self._skip_pending) if self._skip_pending[0] else base

    def _begin_epoch(self, resume: Any) -> tuple[int, int]:
        """Begins an epoch (resumed when `resume` is set): returns how many batches the sampler skips at the
        index level and how many are fetched and discarded; sets the loader's position."""
        self.begin()
        self.set_epoch(self.iteration)
        self._start_epoch(resume)
        offset = self._sampler_offset()
        wanted = resume.skip if resume is not None else 0
        if isinstance(self.dataset, IterableDataset):
            sampler_skip, discard = 0, max(self.skip_batches, wanted)
        else:
            sampler_skip, discard = max(0, wanted - offset), self.skip_batches
        self._position = offset + sampler_skip
        return sampler_skip, discard

    def _new_iterator(self, sampler_skip: int, keep: int = 0) -> Iterator[Any]:
        self._skip_pending = (sampler_skip, keep)
        try:
            return DataLoader.__iter__(self)
        finally:
            self._skip_pending = (0, 0)


def _set_sampler(dl: Any, sampler: Any) -> None:
    if isinstance(dl.sampler, BatchSampler):
        dl.sampler.sampler = sampler
    else:
        dl.batch_sampler.sampler = sampler
        if hasattr(dl.batch_sampler, "batch_sampler"):
            dl.batch_sampler.batch_sampler.sampler = sampler


class DataLoaderShard(_SkippableIndexSampler, ResumableMixin, DataLoaderStateMixin, DataLoader):
    """A DataLoader for one process's shard; see the module header for the per-epoch behaviour."""

    def __init__(self, dataset: Any, device: Any = None, rng_types: Optional[list] = None,
                 synchronized_generator: Any = None, skip_batches: int = 0, use_stateful_dataloader: bool = False,
                 _drop_last: bool = False, _non_blocking: bool = False, torch_device_mesh: Any = None,
                 iteration: int = 0, **kwargs: Any) -> None:
        DataLoader.__init__(self, dataset, **kwargs)
        self.device = device
        self.rng_types = rng_types
        self.synchronized_generator = synchronized_generator
        self.skip_batches = skip_batches
        self.use_stateful_dataloader = use_stateful_dataloader
        self.gradient_state = GradientState()
        self._drop_last = _drop_last
        self._non_blocking = _non_blocking
        self.torch_device_mesh = torch_device_mesh
        self.iteration = iteration

    def __iter__(self) -> Iterator[Any]:
        resume = self._take_resume()
        if resume is None and self.rng_types is not None:
            synchronize_rng_states(self.rng_types, self.synchronized_generator)
        sampler_skip, discard = self._begin_epoch(resume)
        with self._epoch_start_rng(resume):
            it = self._new_iterator(sampler_skip)
            current = next(it, _END)
        if current is _END:
            self._in_epoch = False
            self.end()
            return
        index = 0
        while True:
            if self.device is not None:
                current = send_to_device(current, self.device, non_blocking=self._non_blocking)
            following = next(it, _END)
            if following is _END:
                self.end_of_dataloader = True
            self._position += 1
            if index >= discard:
                yield current
            index += 1
            if following is _END:
                break
            current = following
        self._finish_epoch()
        self.end()

    def set_epoch(self, epoch: int) -> None:
        if self.iteration != epoch:
            self.iteration = epoch
        bs = self.batch_sampler
        if hasattr(bs, "set_epoch"):
            bs.set_epoch(epoch)
        if hasattr(bs, "sampler") and hasattr(bs.sampler, "set_epoch"):
            bs.sampler.set_epoch(epoch)
        inner = getattr(bs, "batch_sampler", None)
        if inner is not None and hasattr(inner, "sampler") and hasattr(inner.sampler, "set_epoch"):
            inner.sampler.set_epoch(epoch)
        elif hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)

    @property
    def total_batch_size(self) -> int:
        bs = self.sampler if isinstance(self.sampler, BatchSampler) else self.batch_sampler
        if getattr(bs, "split_batches", False):
            return bs.batch_size
        return bs.batch_size * getattr(bs, "num_processes", 1)

    @property
    def total_dataset_length(self) -> int:
        return self.dataset.total_length if hasattr(self.dataset, "total_length") else len(self.dataset)

    def get_sampler(self) -> Any:
        return get_sampler(self)

    def set_sampler(self, sampler: Any) -> None:
        _set_sampler(self, sampler)


class _End:
    pass


_END = _End()


class DataLoaderDispatcher(_SkippableIndexSampler, ResumableMixin, DataLoaderStateMixin, DataLoader):
    """Process 0 iterates the wrapped loader, concatenates num_processes batches (or takes one with
    split_batches), broadcasts the result and every process keeps its slice. num_processes and the slice index are
    the data-parallel ones prepare_data_loader sharded with (`_data_ranks`): the ranks of a TP group keep the same
    slice."""

    def __init__(self, dataset: Any, split_batches: bool = False, skip_batches: int = 0,
                 use_stateful_dataloader: bool = False, _drop_last: bool = False, _non_blocking: bool = False,
                 slice_fn: Optional[Callable] = None, torch_device_mesh: Any = None, iteration: int = 0,
                 **kwargs: Any) -> None:
        DataLoader.__init__(self, dataset, **kwargs)
        self.split_batches = split_batches
        self.use_stateful_dataloader = use_stateful_dataloader
        self.gradient_state = GradientState()
        self.state = PartialState()
        self._drop_last = _drop_last
        self._non_blocking = _non_blocking
        self.skip_batches = skip_batches
        self.torch_device_mesh = torch_device_mesh
        self.slice_fn = slice_tensors if slice_fn is None else slice_fn
        self.iteration = iteration
        self._stop_iteration = False

    def _data_ranks(self) -> tuple[int, int]:
        """(number of data-parallel ranks, this rank's index among them): prepare_data_loader's, else the world's."""
        return (getattr(self, "_num_processes_for_state", self.state.num_processes),
                getattr(self, "_process_index_for_state", self.state.process_index))

    def _sampler_units(self) -> int:
        return 1 if self.split_batches else self._data_ranks()[0]

    def _fetch_batches(self, iterator: Any) -> tuple:
        batches, batch = [], None
        if self.state.process_index == 0:
            try:
                if self.split_batches:
                    batch = next(iterator)
                else:
                    for _ in range(self._data_ranks()[0]):
                        batches.append(next(iterator))
                    try:
                        batch = concatenate(batches, dim=0)
                    except RuntimeError as e:
                        raise RuntimeError(
                            "You can't use batches of different size with `dispatch_batches=True` or when using an "
                            "`IterableDataset`.either pass `dispatch_batches=False` and have each process fetch its "
                            "own batch  or pass `split_batches=True`. By doing so, the main process will fetch a full "
                            "batch and slice it into `num_processes` batches for each process.") from e
                info = [get_data_structure(batch), False]
            except StopIteration:
                info = [None, True]
        else:
            info = [None, self._stop_iteration]
        broadcast_object_list(info)
        self._stop_iteration = info[1]
        if self._stop_iteration and not self.split_batches and not self._drop_last:
            # a partial round (fewer than num_processes batches) is still dispatched
            if self.state.process_index == 0 and len(batches) > 0:
                batch = concatenate(batches, dim=0)
                info = [get_data_structure(batch), False]
            else:
                info = [None, True]
            broadcast_object_list(info)
        return batch, info

    def __iter__(self) -> Iterator[Any]:
        resume = self._take_resume()
        sampler_skip, discard = self._begin_epoch(resume)
        n, dp_rank = self._data_ranks()
        rank = self.state.process_index  # process 0 fetches and broadcasts; dp_rank picks the slice
        self._stop_iteration = False
        # A resumed epoch re-reads its first batch (not yielded): it pads the epoch's short last batch.
        keep = self._sampler_units() if sampler_skip and not self._drop_last else 0
        first_batch = None
        with self._epoch_start_rng(resume):
            main_iterator = self._new_iterator(sampler_skip * self._sampler_units(), keep)
            if keep:
                first, info = self._fetch_batches(main_iterator)
                first = broadcast(send_to_device(first if rank == 0 else initialize_tensors(info[0]),
                                                 self.state.device, non_blocking=self._non_blocking), from_process=0)
                first_batch = self.slice_fn(first, slice(0, n), process_index=dp_rank, num_processes=n)
            next_batch, next_info = self._fetch_batches(main_iterator)
        stop = False
        index = 0
        while not stop:
            batch, info = next_batch, next_info
            if rank != 0:
                batch = initialize_tensors(info[0])
            batch = send_to_device(batch, self.state.device, non_blocking=self._non_blocking)
            batch = broadcast(batch, from_process=0)
            if not self._drop_last and first_batch is None:
                # keep num_processes samples of the first batch to complete a short last batch
                first_batch = self.slice_fn(batch, slice(0, n), process_index=dp_rank, num_processes=n)
            if batch is None:
                raise ValueError(f"Batch does not contain any data (`{batch}`). At the end of all iterable data "
                                 "available before expected stop iteration.")
            observed = find_batch_size(batch)
            per_rank = observed // n
            stop = self._stop_iteration
            if not stop:
                next_batch, next_info = self._fetch_batches(main_iterator)
                if self._stop_iteration and next_info[0] is None:
                    stop = True
            if not self._drop_last and stop and observed % n != 0:
                batch = concatenate([batch, first_batch], dim=0)
                per_rank += 1
            batch = self.slice_fn(batch, slice(dp_rank * per_rank, (dp_rank + 1) * per_rank),
                                  process_index=dp_rank, num_processes=n)
            if stop:
                self.end_of_dataloader = True
                self.remainder = observed
            self._position += 1
            if index >= discard:
                yield batch
            index += 1
        self._finish_epoch()
        self.end()

    def set_epoch(self, epoch: int) -> None:
        if self.iteration != epoch:
            self.iteration = epoch
        if hasattr(self.batch_sampler, "sampler") and hasattr(self.batch_sampler.sampler, "set_epoch"):
            self.batch_sampler.sampler.set_epoch(epoch)
        elif hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)

    def __len__(self) -> int:
        whole = DataLoader.__len__(self)
        if self.split_batches:
            return whole
        if self._drop_last:
            return whole // self._data_ranks()[0]
        return math.ceil(whole / self._data_ranks()[0])

    @property
    def total_batch_size(self) -> int:
        return self.dataset.batch_size if self.split_batches else self.dataset.batch_size * self.dataset.num_processes

    @property
    def total_dataset_length(self) -> int:
        return len(self.dataset)

    def get_sampler(self) -> Any:
        return get_sampler(self)

    def set_sampler(self, sampler: Any) -> None:
        _set_sampler(self, sampler)


class SkipDataLoader(ResumableMixin, DataLoaderStateMixin, DataLoader):
    """A plain DataLoader that drops its first `skip_batches` batches at every iteration (HF)."""

    def __init__(self, dataset: Any, skip_batches: int = 0, use_stateful_dataloader: bool = False,
                 **kwargs: Any) -> None:
        DataLoader.__init__(self, dataset, **kwargs)
        self.skip_batches = skip_batches
        self.use_stateful_dataloader = use_stateful_dataloader
        self.gradient_state = GradientState()
        self.iteration = 0
        self._drop_last = kwargs.get("drop_last", False)

    def __iter__(self) -> Iterator[Any]:
        resume = self._take_resume()
        self.begin()
        self._start_epoch(resume)
        self._position = 0
        discard = max(self.skip_batches, resume.skip if resume is not None else 0)
        with self._epoch_start_rng(resume):
            it = DataLoader.__iter__(self)
        for index, batch in enumerate(it):
            self._position += 1
            if index >= discard:
                yield batch
        self._finish_epoch()
        self.end()

    def __len__(self) -> int:
        return DataLoader.__len__(self) - self.skip_batches

    @property
    def total_batch_size(self) -> int:
        return self.batch_size
