# accelerate_c/facade/probes.py: the feature probes HF scripts read on the Accelerator (DeepSpeed, FSDP,
# Megatron-LM, the parallelism config and device mesh, fp8 backend, the *_parallel_rank properties), as a mixin
# (the state's own probes: runtime/probes.py). They answer what HF 1.15 answers: for DeepSpeed/FSDP from the
# state's plugins (state.py sets them), the parallel ranks from the state's parallel layout (the coordinates
# HF reads from its DeviceMesh, without building one; pipeline_parallel_rank, which HF 1.15 always refuses, gives the
# pipeline rank when pp > 1).
# Not for: the features themselves (the layout: runtime/layout.py; the engines).
from __future__ import annotations

from typing import Any

from ..base import settings
from ..base.dataclasses import FP8BackendType


class AcceleratorProbes:
    """Accelerator properties that mirror the state's probes plus fp8 and the parallel ranks."""

    state: Any
    fp8_recipe_handler: Any

    @property
    def deepspeed_plugin(self) -> Any:
        return self.state.deepspeed_plugin

    @property
    def parallelism_config(self) -> Any:
        return self.state.parallelism_config

    @property
    def torch_device_mesh(self) -> Any:
        """torch's DeviceMesh of the parallel layout (HF's names; built on first use: every rank must ask), None
        without a ParallelismConfig (as HF)."""
        return self.state.device_mesh

    @property
    def is_fsdp2(self) -> bool:
        return self.state.is_fsdp2

    @property
    def is_composable_parallelism_enabled(self) -> bool:
        return self.is_fsdp2

    @property
    def fp8_enabled(self) -> bool:
        return self.state.mixed_precision == "fp8"

    @property
    def has_fp8_handler(self) -> bool:
        return self.fp8_recipe_handler is not None

    @property
    def fp8_backend(self) -> FP8BackendType:
        """The backend named by FP8RecipeKwargs(backend=...), else ACCELERATE_FP8_BACKEND, else NO (accelerate_c's
        own fp8 path is none of HF's TE/MSAMP/AO)."""
        backend = (getattr(self.fp8_recipe_handler, "backend", None)
                   or settings.env_value("ACCELERATE_FP8_BACKEND", "NO"))
        try:
            return FP8BackendType(str(getattr(backend, "value", backend)).upper())
        except ValueError:
            raise ValueError(f"unknown fp8 backend {backend!r}; allowed: {[b.value for b in FP8BackendType]}") from None

    @staticmethod
    def verify_device_map(model: Any) -> bool:
        """HF's: whether `model` (or a submodule) was dispatched over more than one device (`hf_device_map`)."""
        return any(len(getattr(m, "hf_device_map", None) or ()) > 1 for m in model.modules())

    def _places(self, model: Any, device_placement: bool) -> bool:
        """prepare_model's device placement for `model`: a dispatched model stays where its hooks put it, and is
        refused in a distributed run (HF's error; ACCELERATE_BYPASS_DEVICE_MAP=true skips the check, as HF)."""
        if not self.verify_device_map(model):
            return device_placement
        if self.state.num_processes > 1 and not settings.env_flag("ACCELERATE_BYPASS_DEVICE_MAP"):
            raise ValueError("You can't train a model that has been loaded with `device_map='auto'` in any distributed "
                             "mode. Please rerun your script specifying `--num_processes=1` or by launching with "
                             "`python {{myscript.py}}`.")
        return False

    @property
    def should_save_model(self) -> bool:
        # HF: the local main process without a parallelism config, else every process
        if self.parallelism_config is None:
            return self.state.is_local_main_process
        return True

    def _parallel_rank(self, dim: str, what: str) -> int:
        if self.parallelism_config is None and self.state.megatron_lm_plugin is None:
            raise RuntimeError(f"{what} is not configured. Set `parallelism_config` first.")
        return self.state.parallel_layout.coords[dim]

    @property
    def tensor_parallel_rank(self) -> int:
        return self._parallel_rank("tp", "Tensor parallelism")

    @property
    def data_parallel_rank(self) -> int:
        return self._parallel_rank("dp_replicate", "Data parallelism")

    @property
    def data_parallel_shard_rank(self) -> int:
        return self._parallel_rank("dp_shard", "Shard-based data parallelism")

    @property
    def pipeline_parallel_rank(self) -> int:
        """This rank's pipeline stage index (its coordinate in the pipeline group) when pipeline parallelism is on
        (ParallelismConfig pp_size > 1 or MegatronLMPlugin pp_degree > 1); otherwise HF 1.15's answer, which has no
        pipeline parallelism: its NotImplementedError."""
        if self.state.parallel_layout.pp > 1:
            return self.state.parallel_layout.pp_rank
        raise NotImplementedError("Pipeline parallelism is currently not supported in Accelerate.")

    @property
    def context_parallel_rank(self) -> int:
        raise NotImplementedError("Context parallelism is currently not supported in Accelerate.")
