# accelerate_c/data_loader.py: HF's `accelerate.data_loader` module surface; the code lives in accelerate_c/data/.
# Not for: any logic of its own.
from .data.loaders import DataLoaderDispatcher, DataLoaderShard, SkipDataLoader
from .data.prepare import _PYTORCH_DATALOADER_KWARGS, prepare_data_loader, skip_first_batches
from .data.resume import DataLoaderStateMixin, get_sampler
from .data.samplers import BatchSamplerShard, IterableDatasetShard, SeedableRandomSampler, SkipBatchSampler

__all__ = ["BatchSamplerShard", "DataLoaderDispatcher", "DataLoaderShard", "DataLoaderStateMixin",
           "IterableDatasetShard", "SeedableRandomSampler", "SkipBatchSampler", "SkipDataLoader", "get_sampler",
           "prepare_data_loader", "skip_first_batches"]
