# accelerate_c/data/prepare.py: prepare_data_loader (turn a user DataLoader into this process's
# DataLoaderShard/DataLoaderDispatcher, HF 1.15 semantics) and skip_first_batches (a loader that skips
# the first batches, keeping every setting of the original and linked to it for resume bookkeeping). A loader whose
# batches go to a CUDA device with non_blocking=True pins its memory (runtime/device.py pin_for_device).
# Not for: the iteration loops (data/loaders.py) or the index arithmetic (data/samplers.py).
from __future__ import annotations

from typing import Any, Callable, Optional, Union

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler

from ..runtime.device import pin_for_device
from ..runtime.state import PartialState
from ..base.dataclasses import DistributedType, RNGType
from .loaders import DataLoaderDispatcher, DataLoaderShard, SkipDataLoader
from .resume import get_sampler
from .samplers import BatchSamplerShard, IterableDatasetShard, SeedableRandomSampler, SkipBatchSampler, \
    _default_generator

# DataLoader constructor arguments (and defaults) carried over from the user's loader.
_PYTORCH_DATALOADER_KWARGS = {
    "batch_size": 1, "shuffle": False, "sampler": None, "batch_sampler": None, "num_workers": 0,
    "collate_fn": None, "pin_memory": False, "drop_last": False, "timeout": 0, "worker_init_fn": None,
    "multiprocessing_context": None, "generator": None, "prefetch_factor": 2, "persistent_workers": False,
    "pin_memory_device": "", "in_order": True,
}
_IGNORED = ("batch_size", "shuffle", "sampler", "batch_sampler", "drop_last")


def _carried_kwargs(dataloader: Any) -> dict:
    return {k: getattr(dataloader, k, default) for k, default in _PYTORCH_DATALOADER_KWARGS.items()
            if k not in _IGNORED}


def _is_datasets_iterable(dataset: Any) -> bool:
    try:
        from datasets import IterableDataset as DatasetsIterableDataset
    except Exception:
        return False
    return isinstance(dataset, DatasetsIterableDataset)


def prepare_data_loader(dataloader: DataLoader, device: Optional[torch.device] = None,
                        num_processes: Optional[int] = None, process_index: Optional[int] = None,
                        split_batches: bool = False, put_on_device: bool = False,
                        rng_types: Optional[list[Union[str, RNGType]]] = None, dispatch_batches: Optional[bool] = None,
                        even_batches: bool = True, slice_fn_for_dispatch: Optional[Callable] = None,
                        use_seedable_sampler: bool = False, data_seed: Optional[int] = None,
                        non_blocking: bool = False, use_stateful_dataloader: bool = False,
                        torch_device_mesh: Any = None) -> DataLoader:
    """Wrap `dataloader` so it yields this process's part of every batch (HF's prepare_data_loader)."""
    if dispatch_batches is None:
        dispatch_batches = put_on_device and isinstance(dataloader.dataset, IterableDataset)
    if dispatch_batches and not put_on_device:
        raise ValueError("Using `dispatch_batches=True` requires `put_on_device=True`.")
    state = PartialState()
    num_processes, process_index = _data_ranks(state, num_processes, process_index, torch_device_mesh)

    if split_batches:
        _check_split_batches(dataloader, num_processes)

    new_dataset = dataloader.dataset
    new_batch_sampler = dataloader.batch_sampler if not isinstance(new_dataset, IterableDataset) else None
    sampler_is_batch_sampler = isinstance(dataloader.sampler, BatchSampler)
    synchronized_generator = None

    sampler = get_sampler(dataloader)
    if isinstance(sampler, RandomSampler) and use_seedable_sampler:
        sampler = _seedable(sampler, data_seed)

    if (num_processes != 1 or state.distributed_type == DistributedType.MEGATRON_LM) and not dispatch_batches:
        if (_is_datasets_iterable(new_dataset) and not split_batches
                and new_dataset.n_shards >= num_processes):
            new_dataset = new_dataset.shard(num_shards=num_processes, index=process_index)
        elif isinstance(new_dataset, IterableDataset):
            if getattr(dataloader.dataset, "generator", None) is not None:
                synchronized_generator = dataloader.dataset.generator
            new_dataset = IterableDatasetShard(new_dataset, batch_size=dataloader.batch_size,
                                               drop_last=dataloader.drop_last, num_processes=num_processes,
                                               process_index=process_index, split_batches=split_batches)
        else:
            if not use_seedable_sampler and hasattr(sampler, "generator"):
                if sampler.generator is None:
                    # every process needs the same permutation: give the sampler a generator to synchronise
                    sampler.generator = _default_generator()
                    sampler.generator.manual_seed(int(torch.empty((), dtype=torch.int64).random_().item()))
                synchronized_generator = sampler.generator
            batch_sampler = dataloader.sampler if sampler_is_batch_sampler else dataloader.batch_sampler
            new_batch_sampler = BatchSamplerShard(batch_sampler, num_processes=num_processes,
                                                  process_index=process_index, split_batches=split_batches,
                                                  even_batches=even_batches)

    if rng_types is not None and synchronized_generator is None and "generator" in rng_types:
        rng_types.remove("generator")

    kwargs = _carried_kwargs(dataloader)
    if new_batch_sampler is None:
        kwargs["drop_last"] = dataloader.drop_last
        kwargs["batch_size"] = (dataloader.batch_size // num_processes if split_batches and not dispatch_batches
                                else dataloader.batch_size)
    target = device if put_on_device and state.distributed_type != DistributedType.XLA else None
    kwargs["pin_memory"] = pin_for_device(state.device if dispatch_batches else target, non_blocking,
                                          kwargs.get("pin_memory", False))
    common = dict(_drop_last=dataloader.drop_last, _non_blocking=non_blocking,
                  use_stateful_dataloader=use_stateful_dataloader, torch_device_mesh=torch_device_mesh)
    if dispatch_batches:
        kwargs.pop("generator")
        new_dl: Any = DataLoaderDispatcher(new_dataset, split_batches=split_batches, batch_sampler=new_batch_sampler,
                                           slice_fn=slice_fn_for_dispatch, **common, **kwargs)
    elif sampler_is_batch_sampler:
        new_dl = DataLoaderShard(new_dataset, device=target, sampler=new_batch_sampler,
                                 batch_size=dataloader.batch_size, rng_types=rng_types,
                                 synchronized_generator=synchronized_generator, **common, **kwargs)
    else:
        new_dl = DataLoaderShard(new_dataset, device=target, batch_sampler=new_batch_sampler, rng_types=rng_types,
                                 synchronized_generator=synchronized_generator, **common, **kwargs)
    if isinstance(sampler, SeedableRandomSampler) and use_seedable_sampler:
        new_dl.set_sampler(sampler)
    new_dl._num_processes_for_state = num_processes
    new_dl._process_index_for_state = process_index
    return new_dl


def _data_ranks(state: Any, num_processes: Optional[int], process_index: Optional[int],
                mesh: Any) -> tuple[int, int]:
    """(number of data-parallel ranks, this rank's index among them): the given ones (the Accelerator passes its
    layout's, which also hold with a pipeline dimension), else the world's; with a DeviceMesh, HF's rule: the
    ranks of a "tp" (and "cp") group read the same batch (tp innermost, then cp; only "tp" under DeepSpeed)."""
    num_processes = state.num_processes if num_processes is None else num_processes
    process_index = state.process_index if process_index is None else process_index
    if not mesh:
        return num_processes, process_index
    names = mesh.mesh_dim_names or ()
    size = {n: mesh[n].size() if n in names else 1 for n in ("tp", "cp", "dp_replicate", "dp_shard")}
    if state.distributed_type == DistributedType.DEEPSPEED:
        return num_processes // size["tp"], process_index // size["tp"]
    return size["dp_shard"] * size["dp_replicate"], process_index // (size["tp"] * size["cp"])


def _seedable(sampler: RandomSampler, data_seed: Optional[int]) -> SeedableRandomSampler:
    """The RandomSampler's SeedableRandomSampler twin (use_seedable_sampler)."""
    return SeedableRandomSampler(data_source=sampler.data_source, replacement=sampler.replacement,
                                 num_samples=sampler._num_samples,
                                 generator=getattr(sampler, "generator", _default_generator()), data_seed=data_seed)


def _check_split_batches(dataloader: DataLoader, num_processes: int) -> None:
    """split_batches needs a batch size that the number of processes divides (HF's errors)."""
    if dataloader.batch_size is not None:
        check = dataloader.batch_size
    elif hasattr(dataloader.batch_sampler, "batch_size"):
        check = dataloader.batch_sampler.batch_size
    else:
        raise ValueError(
            "In order to use `split_batches==True` you must have a `batch_size` attribute either in the passed "
            "`dataloader` or `dataloader.batch_sampler` objects, and it has to return a natural number. "
            "Your `dataloader.batch_size` is None and `dataloader.batch_sampler` "
            f"(`{type(dataloader.batch_sampler)}`) does not have the `batch_size` attribute set.")
    if check > 1 and check % num_processes != 0:
        raise ValueError(f"To use a `DataLoader` in `split_batches` mode, the batch size ({dataloader.batch_size}) "
                         f"needs to be a round multiple of the number of processes ({num_processes}).")


def skip_first_batches(dataloader: DataLoader, num_batches: int = 0) -> DataLoader:
    """A loader yielding the batches of `dataloader` after the first `num_batches` (at every iteration, as
    HF). Unlike HF 1.15 it keeps drop_last, non_blocking, slice_fn, device mesh and stateful settings, and
    for prepared loaders it reports its progress (epoch, position) back to `dataloader`."""
    dataset = dataloader.dataset
    sampler_is_batch_sampler = False
    if isinstance(dataset, IterableDataset):
        new_batch_sampler = None
    else:
        sampler_is_batch_sampler = isinstance(dataloader.sampler, BatchSampler)
        batch_sampler = dataloader.sampler if sampler_is_batch_sampler else dataloader.batch_sampler
        new_batch_sampler = SkipBatchSampler(batch_sampler, skip_batches=num_batches)
    kwargs = _carried_kwargs(dataloader)
    if new_batch_sampler is None:
        kwargs["drop_last"] = dataloader.drop_last
        kwargs["batch_size"] = dataloader.batch_size
    common = dict(_drop_last=getattr(dataloader, "_drop_last", dataloader.drop_last),
                  _non_blocking=getattr(dataloader, "_non_blocking", False),
                  use_stateful_dataloader=getattr(dataloader, "use_stateful_dataloader", False),
                  torch_device_mesh=getattr(dataloader, "torch_device_mesh", None),
                  iteration=getattr(dataloader, "iteration", 0))
    if isinstance(dataloader, DataLoaderDispatcher):
        if new_batch_sampler is None:
            kwargs["skip_batches"] = num_batches
        kwargs.pop("generator", None)
        new_dl: Any = DataLoaderDispatcher(dataset, split_batches=dataloader.split_batches,
                                           batch_sampler=new_batch_sampler, slice_fn=dataloader.slice_fn,
                                           **common, **kwargs)
    elif isinstance(dataloader, DataLoaderShard):
        if new_batch_sampler is None:
            kwargs["skip_batches"] = num_batches
        elif sampler_is_batch_sampler:
            kwargs["sampler"] = new_batch_sampler
            kwargs["batch_size"] = dataloader.batch_size
        else:
            kwargs["batch_sampler"] = new_batch_sampler
        new_dl = DataLoaderShard(dataset, device=dataloader.device, rng_types=dataloader.rng_types,
                                 synchronized_generator=dataloader.synchronized_generator, **common, **kwargs)
    elif new_batch_sampler is None:
        return SkipDataLoader(dataset, skip_batches=num_batches, **kwargs)
    else:
        return DataLoader(dataset, batch_sampler=new_batch_sampler, **kwargs)
    for attr in ("_num_processes_for_state", "_process_index_for_state"):
        if hasattr(dataloader, attr):
            setattr(new_dl, attr, getattr(dataloader, attr))
    new_dl._adopt(dataloader, num_batches)
    return new_dl
