# accelerate_c/data/samplers.py: the index-level sharding pieces of HF Accelerate's data_loader
# (SeedableRandomSampler, BatchSamplerShard, IterableDatasetShard, SkipBatchSampler) with HF's exact
# per-rank orders, plus _ResumeSkip, the lazy "drop the first n batches once" wrapper used to resume a
# loader mid-epoch without loading the skipped data.
# Not for: DataLoader subclasses, device placement, RNG synchronisation (data/loaders.py).
from __future__ import annotations

import math
from typing import Any, Iterator, Optional

import torch
from torch.utils.data import BatchSampler, IterableDataset, RandomSampler


def _default_generator() -> torch.Generator:
    return torch.Generator(device=torch.get_default_device() if hasattr(torch, "get_default_device") else "cpu")


class SeedableRandomSampler(RandomSampler):
    """RandomSampler whose permutation for epoch e is drawn from a generator seeded with initial_seed + e,
    so every process (and every resumed run) gets the same order."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        data_seed = kwargs.pop("data_seed", None)
        super().__init__(*args, **kwargs)
        self.initial_seed = data_seed if data_seed is not None else torch.random.initial_seed()
        self.epoch = 0

    def __iter__(self) -> Iterator[int]:
        if self.generator is None:
            self.generator = _default_generator()
        self.generator.manual_seed(self.initial_seed + self.epoch)
        yield from super().__iter__()
        self.set_epoch(self.epoch + 1)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch


class BatchSamplerShard(BatchSampler):
    """One process's share of a batch sampler. Without split_batches rank r takes batches r, r+N, ...;
    with it every batch is cut in N equal slices. even_batches completes the last round by cycling indices
    from the start of the epoch so all ranks yield the same number of full batches."""

    def __init__(self, batch_sampler: BatchSampler, num_processes: int = 1, process_index: int = 0,
                 split_batches: bool = False, even_batches: bool = True) -> None:
        self.batch_sampler = batch_sampler
        self.num_processes = num_processes
        self.process_index = process_index
        self.split_batches = split_batches
        self.even_batches = even_batches
        self.batch_size = getattr(batch_sampler, "batch_size", None)
        self.drop_last = getattr(batch_sampler, "drop_last", False)
        if split_batches and (self.batch_size is None or self.batch_size % num_processes != 0):
            raise ValueError(f"To use `BatchSamplerShard` in `split_batches` mode, the batch size ({self.batch_size}) "
                             f"needs to be a round multiple of the number of processes ({num_processes}).")

    @property
    def total_length(self) -> int:
        return len(self.batch_sampler)

    def __len__(self) -> int:
        n = len(self.batch_sampler)
        if self.split_batches:
            return n
        full, extra = divmod(n, self.num_processes)
        if extra == 0 or self.drop_last:
            return full
        if self.even_batches:
            return full + 1
        return full + (1 if self.process_index < extra else 0)

    def __iter__(self) -> Iterator[list]:
        return self._iter_split() if self.split_batches else self._iter_rounds()

    def _iter_split(self) -> Iterator[list]:
        width = self.batch_size // self.num_processes
        lo, hi = width * self.process_index, width * (self.process_index + 1)
        first: list = []
        last: list = []
        for i, batch in enumerate(self.batch_sampler):
            if i == 0:
                first = batch
            last = batch
            if len(batch) == self.batch_size:
                yield batch[lo:hi]
        if self.drop_last or not first or len(last) >= self.batch_size:
            return
        if not self.even_batches:
            if len(last) > lo:
                yield last[lo:hi]
            return
        pool = list(first)
        while len(pool) < self.batch_size:  # tiny datasets: repeat the first batch until it can fill one
            pool = pool + pool
        yield (list(last) + pool)[lo:hi]

    def _iter_rounds(self) -> Iterator[list]:
        n, rank, bs = self.num_processes, self.process_index, self.batch_size
        keep_head = not self.drop_last
        head: list = []  # indices (or whole batches when bs is None) of the first n batches, to cycle from
        mine: Optional[list] = None  # this rank's batch of the current round, held until the round is complete
        idx, last = -1, []
        for idx, batch in enumerate(self.batch_sampler):
            last = batch
            if keep_head and idx < n:
                if bs is None:
                    head.append(batch)
                else:
                    head.extend(batch)
            if idx % n == rank:
                mine = batch
            if idx % n == n - 1 and (bs is None or len(batch) == bs):
                yield mine
                mine = None
        if not keep_head or not head:
            return
        if not self.even_batches:
            if mine:
                yield mine
            return
        if mine and (bs is None or len(mine) == bs):
            yield mine
        need = n * bs if bs is not None else n
        while len(head) < need:
            head = head + head
        # Complete the round: the slot after a full last batch starts empty; a short last batch gets topped up.
        pending = list(last)
        if bs is None or len(last) == bs:
            pending, idx = [], idx + 1
        pos = 0
        while idx % n != 0 or pending:
            if bs is None:
                pending, pos = head[pos], pos + 1
            else:
                take = bs - len(pending)
                pending, pos = pending + head[pos:pos + take], pos + take
            if idx % n == rank:
                yield pending
            pending, idx = [], idx + 1


class IterableDatasetShard(IterableDataset):
    """One process's share of an iterable dataset: buffers one global batch (bs*N, or bs with split_batches)
    and yields this rank's slice; the last partial global batch is completed from the first one."""

    def __init__(self, dataset: Any, batch_size: int = 1, drop_last: bool = False, num_processes: int = 1,
                 process_index: int = 0, split_batches: bool = False) -> None:
        if split_batches and batch_size > 1 and batch_size % num_processes != 0:
            raise ValueError(f"To use `IterableDatasetShard` in `split_batches` mode, the batch size ({batch_size}) "
                             f"needs to be a round multiple of the number of processes ({num_processes}).")
        self.dataset = dataset
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.num_processes = num_processes
        self.process_index = process_index
        self.split_batches = split_batches

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)

    def __len__(self) -> int:
        per_round = self.batch_size * self.num_processes
        rounds = len(self.dataset) // per_round if self.drop_last else math.ceil(len(self.dataset) / per_round)
        return rounds * self.batch_size

    def __iter__(self) -> Iterator[Any]:
        gen = getattr(self.dataset, "generator", None)
        if not hasattr(self.dataset, "set_epoch") and isinstance(gen, torch.Generator):
            gen.manual_seed(self.epoch)
        if self.split_batches:
            total, mine = self.batch_size, self.batch_size // self.num_processes
        else:
            total, mine = self.batch_size * self.num_processes, self.batch_size
        lo, hi = self.process_index * mine, (self.process_index + 1) * mine
        first: Optional[list] = None
        buf: list = []
        for item in self.dataset:
            buf.append(item)
            if len(buf) == total:
                yield from buf[lo:hi]
                if first is None:
                    first = list(buf)
                buf = []
        if self.drop_last or not buf:
            return
        if first is None:
            first = list(buf)
        while len(buf) < total:
            buf = buf + first
        yield from buf[lo:hi]


class SkipBatchSampler(BatchSampler):
    """Yields the batches of `batch_sampler` after the first `skip_batches` (at every iteration, as HF)."""

    def __init__(self, batch_sampler: Any, skip_batches: int = 0) -> None:
        self.batch_sampler = batch_sampler
        self.skip_batches = skip_batches

    def __iter__(self) -> Iterator[Any]:
        for i, batch in enumerate(self.batch_sampler):
            if i >= self.skip_batches:
                yield batch

    @property
    def total_length(self) -> int:
        return len(self.batch_sampler)

    def __len__(self) -> int:
        return len(self.batch_sampler) - self.skip_batches


class _ResumeSkip:
    """Index-sampler wrapper that drops items keep..n-1 ONCE (the first iteration actually started), still
    drawing them from the inner sampler so its RNG advances exactly as in an uninterrupted epoch. `keep`
    lets the dispatcher re-read the epoch's first batch, which pads the epoch's last one.
    Lazy on purpose: torch's DataLoader iterators call iter() on it before drawing their base seed."""

    def __init__(self, inner: Any, n: int, keep: int = 0) -> None:
        self.inner = inner
        self.n = n
        self.keep = keep

    def __len__(self) -> int:
        return max(0, len(self.inner) - self.n + min(self.keep, self.n))

    def __iter__(self) -> Iterator[Any]:
        n, keep, self.n, self.keep = self.n, self.keep, 0, 0
        for i, item in enumerate(self.inner):
            if i < keep or i >= n:
                yield item

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)
