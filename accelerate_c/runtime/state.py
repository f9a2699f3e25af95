# accelerate_c/runtime/state.py: the process-wide state singletons HF scripts import directly:
# PartialState (who am I, which device: runtime/device.py decides, the process group), AcceleratorState (adds the
# precision mode, the sharding plugins, duck-typed: the Accelerator settles them, facade/plugins.py, and the parallel
# layout, layout.py: trivial here, the Accelerator's when it has a parallel config); GradientState lives in
# gradient.py and is re-exported here (HF's import path).
# They are "Borg" objects (every instance shares one __dict__), as in HF Accelerate.
# Not for: backend decisions beyond picking the device and the process-group backend (strategies do that).
from __future__ import annotations

import os
import warnings
from contextlib import contextmanager
from datetime import timedelta
from functools import partial
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist

from . import affinity
from .device import default_backend, select_device
from .layout_build import trivial_layout
from .borg import reduce_shared
from .probes import StateProbes
from .gradient import GradientState  # noqa: F401  (HF's import path: accelerate.state)
from ..base import settings
from ..base.dataclasses import DistributedType

_RESET_TEXT = (
    "`{cls}` object has no attribute `{name}`. This happens if `{cls}._reset_state()` was called and "
    "an `Accelerator` or `PartialState` was not reinitialized."
)


_get_group: Optional[Callable[[], Any]] = None


def _comm_group() -> Any:
    """accelerate_c.comm.get_group() (imported on first use: a script that never synchronises never loads comm)."""
    global _get_group
    if _get_group is None:
        from ..comm import get_group
        _get_group = get_group
    return _get_group()


class PartialState:
    """Rank, world size, device and process group; created once per process, shared by every instance."""

    _shared_state: dict[str, Any] = {}
    _known_attrs = ["_cpu", "backend", "device", "distributed_type", "fork_launched", "local_process_index",
                    "num_processes", "process_index", "debug"]

    def __init__(self, cpu: bool = False, **kwargs: Any) -> None:
        self.__dict__ = self._shared_state
        if self.initialized:
            return
        self._cpu = bool(cpu) or settings.env_flag("ACCELERATE_USE_CPU")
        self.debug = settings.env_flag("ACCELERATE_DEBUG_MODE")
        self.fork_launched = settings.env_flag("FORK_LAUNCHED")
        world = settings.env_int("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", default=1)
        rank = settings.env_int("RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK", default=0)
        local_rank = settings.env_int("LOCAL_RANK", "MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK", default=rank)
        distributed = world > 1 or dist.is_initialized()
        forced = settings.env_value("ACCELERATE_TORCH_DEVICE")  # HF: this device, whatever select_device would say
        device = torch.device(forced) if forced else select_device(self._cpu, local_rank, distributed)
        use_cuda = device.type == "cuda"
        self.backend: Optional[str] = None
        if distributed:
            if not dist.is_initialized():
                # the Accelerator's InitProcessGroupKwargs, and, as HF, init_process_group's own keywords given to
                # PartialState (`PartialState(**InitProcessGroupKwargs(...).to_kwargs())`, HF's documented way)
                init_kwargs = {**(kwargs.get("init_kwargs") or {}),
                               **{k: v for k, v in kwargs.items() if k != "init_kwargs" and not k.startswith("_")}}
                backend = default_backend(device, init_kwargs.pop("backend", None))
                timeout = init_kwargs.pop("timeout", None) or timedelta(seconds=1800)
                settings.env_setdefault("MASTER_ADDR", "127.0.0.1")
                settings.env_setdefault("MASTER_PORT", "29500")
                if use_cuda:
                    torch.cuda.set_device(device)
                dist.init_process_group(backend=backend, init_method=init_kwargs.pop("init_method", None),
                                        rank=rank, world_size=world, timeout=timeout, **init_kwargs)
            elif use_cuda:
                torch.cuda.set_device(device)
            self.backend = dist.get_backend()
            world, rank = dist.get_world_size(), dist.get_rank()
        self.num_processes = world
        self.process_index = rank
        self.local_process_index = local_rank if world > 1 else 0
        self.local_num_processes = settings.env_int("LOCAL_WORLD_SIZE", default=world if world > 1 else 1)
        self.device = device
        if settings.env_flag("ACCELERATE_CPU_AFFINITY"):  # launch --enable_cpu_affinity (HF's name and moment)
            affinity.apply(device, self.local_process_index, self.local_num_processes, verbose=self.debug)
        if world == 1:
            self.distributed_type = DistributedType.NO
        elif use_cuda:
            self.distributed_type = DistributedType.MULTI_GPU
        else:
            self.distributed_type = DistributedType.MULTI_CPU
        if world > 1 and not use_cuda and not settings.env_is_set("OMP_NUM_THREADS"):
            # Ranks sharing a host share its cores: give each its fair part, as HF does.
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, self.local_num_processes)))

    def __repr__(self) -> str:
        backend = f"  Backend: {self.backend}" if self.backend else ""
        return (f"Distributed environment: {self.distributed_type}{backend}\nNum processes: {self.num_processes}\n"
                f"Process index: {self.process_index}\nLocal process index: {self.local_process_index}\n"
                f"Device: {self.device}\n")

    @staticmethod
    def _reset_state() -> None:
        PartialState._shared_state.clear()

    @property
    def initialized(self) -> bool:
        return self._shared_state != {}

    def __reduce__(self) -> tuple:  # a view of this process's state (borg.py)
        return reduce_shared(self, *(() if type(self) is PartialState else (PartialState,)))

    @property
    def use_distributed(self) -> bool:
        return self.distributed_type != DistributedType.NO and self.num_processes > 1

    @property
    def is_main_process(self) -> bool:
        return self.process_index == 0

    @property
    def is_local_main_process(self) -> bool:
        return self.local_process_index == 0

    @property
    def is_last_process(self) -> bool:
        return self.process_index == self.num_processes - 1

    @property
    def default_device(self) -> torch.device:
        """The device a single process computes on (runtime/device.py's choice): cuda, mps or cpu."""
        return select_device(self._cpu, 0, False)

    def set_device(self) -> None:
        """HF's: sets `device` for this process when it is not set (ours is chosen when the state is made)."""
        if self.__dict__.get("device") is None:
            self.device = select_device(self._cpu, self.local_process_index, self.num_processes > 1)

    def wait_for_everyone(self) -> None:
        """Blocks until every process got here: the barrier of accelerate_c.comm's default group (shared
        memory within a host, ~us; its waiters sleep on a futex, so main_process_first costs the others no
        CPU; a dead peer or the process-group timeout raises), dist.barrier under ACCELERATE_C_COMM=torch
        or with one process per host."""
        if self.use_distributed:
            _comm_group().barrier()

    def _goes_first(self, is_main: bool) -> Iterator[None]:
        if not is_main:
            self.wait_for_everyone()
        yield
        if is_main:
            self.wait_for_everyone()

    @contextmanager
    def main_process_first(self) -> Iterator[None]:
        yield from self._goes_first(self.is_main_process)

    @contextmanager
    def local_main_process_first(self) -> Iterator[None]:
        yield from self._goes_first(self.is_local_main_process)

    @contextmanager
    def split_between_processes(self, inputs: Any, apply_padding: bool = False) -> Iterator[Any]:
        """Yields this process's contiguous share of a list/tuple/tensor/dict of them (the first ranks get
        one extra element when the length does not divide); apply_padding repeats the last element."""
        if self.num_processes == 1:
            yield inputs
            return
        if isinstance(inputs, dict):
            lengths = {k: len(v) for k, v in inputs.items()}
            if len(set(lengths.values())) > 1:
                raise ValueError(f"All values in the dictionary must have the same length, got {lengths}")
            length = next(iter(lengths.values()))
        else:
            length = len(inputs)
        per, extras = divmod(length, self.num_processes)
        start = self.process_index * per + min(self.process_index, extras)
        end = start + per + (1 if self.process_index < extras else 0)
        target = per + (1 if extras > 0 else 0)  # every share's length once padded

        def split(values: Any) -> Any:
            if isinstance(values, dict):
                return {k: split(v) for k, v in values.items()}
            if isinstance(values, (list, tuple, torch.Tensor)):
                part = values[start:end]
                if apply_padding:
                    if start >= len(values):  # fewer inputs than processes: pad from the last one
                        part = values[-1:]
                    if isinstance(part, torch.Tensor):
                        part = _pad_rows(part.to(self.device), target, values[-1])
                    else:
                        part = part + type(part)([values[-1]]) * (target - len(part))
                return part
            if hasattr(values, "select") and hasattr(values, "__len__"):  # datasets.Dataset
                rows = list(range(min(start, len(values)), min(end, len(values))))
                if apply_padding:
                    rows += [len(values) - 1] * (target - len(rows))
                return values.select(rows)
            return values

        yield split(inputs)

    def on_main_process(self, function: Optional[Callable] = None) -> Callable:
        return function if self.is_main_process else (lambda *a, **k: None)

    def on_local_main_process(self, function: Optional[Callable] = None) -> Callable:
        return function if self.is_local_main_process else (lambda *a, **k: None)

    def on_last_process(self, function: Callable) -> Callable:
        return function if self.is_last_process else (lambda *a, **k: None)

    def on_process(self, function: Optional[Callable] = None, process_index: Optional[int] = None) -> Callable:
        if function is None:
            return partial(self.on_process, process_index=process_index)
        return function if self.process_index == process_index else (lambda *a, **k: None)

    def on_local_process(self, function: Optional[Callable] = None,
                         local_process_index: Optional[int] = None) -> Callable:
        if function is None:
            return partial(self.on_local_process, local_process_index=local_process_index)
        return function if self.local_process_index == local_process_index else (lambda *a, **k: None)

    def print(self, *args: Any, **kwargs: Any) -> None:
        if self.is_local_main_process:
            print(*args, **kwargs)

    def destroy_process_group(self, group: Any = None) -> None:
        if self.use_distributed and dist.is_initialized():
            if group is None:  # the shared-memory groups built over the default group go with it
                from ..comm import release_groups
                release_groups()
            # A barrier first: a rank tearing gloo down while a peer is still finishing its last
            # collective can abort the peer ("terminate called without an active exception").
            dist.barrier(group=group)
            dist.destroy_process_group(group)

    def __getattr__(self, name: str) -> Any:
        if name in self._known_attrs:
            raise AttributeError(_RESET_TEXT.format(cls="PartialState", name=name))
        raise AttributeError(f"'PartialState' object has no attribute '{name}'")


def _pad_rows(t: torch.Tensor, rows: int, fill: Any) -> torch.Tensor:
    """`t` padded along dim 0 to `rows` with `fill` (what pad_across_processes gives here: every rank's part of
    split_between_processes has at most `rows` rows and one has exactly that many, so no sizes are exchanged)."""
    if t.ndim == 0 or t.shape[0] >= rows:
        return t
    out = t.new_zeros((rows, *t.shape[1:])) + fill
    out[:t.shape[0]] = t
    return out


class AcceleratorState(StateProbes):
    """PartialState plus the mixed-precision mode and the plugins (probes.py); shared by every instance."""

    _shared_state: dict[str, Any] = {}
    _known_attrs = PartialState._known_attrs + ["mixed_precision", "_mixed_precision", "deepspeed_plugin",
                                                "fsdp_plugin", "megatron_lm_plugin", "dynamo_plugin",
                                                "parallel_layout"]

    def __init__(self, mixed_precision: Optional[str] = None, cpu: bool = False, dynamo_plugin: Any = None,
                 deepspeed_plugin: Any = None, fsdp_plugin: Any = None, torch_tp_plugin: Any = None,
                 megatron_lm_plugin: Any = None, parallelism_config: Any = None, _from_accelerator: bool = False,
                 **kwargs: Any) -> None:
        # (HF's signature: the three parallel settings are the Accelerator's to settle here; the rest of kwargs are
        # PartialState's, init_process_group's keywords included)
        self.__dict__ = self._shared_state
        if PartialState._shared_state == {}:
            PartialState(cpu, **kwargs)
        self.__dict__.update(PartialState._shared_state)
        if (self.initialized_precision and mixed_precision is not None and mixed_precision != self._mixed_precision
                and self.distributed_type != DistributedType.DEEPSPEED):
            raise ValueError("AcceleratorState has already been initialized and cannot be changed, restart your "
                             "runtime completely and pass `mixed_precision` to `Accelerator()`.")
        if not self.initialized_precision:
            if mixed_precision is None:
                mixed_precision = settings.env_value("ACCELERATE_MIXED_PRECISION", "no")
            mp = str(mixed_precision).lower()
            if mp not in ("no", "fp16", "bf16", "fp8"):
                raise ValueError(f"Unknown mixed_precision mode: {mp!r}. Choose between no, fp16, bf16, fp8.")
            self._init_plugins(dynamo_plugin)
            self._mixed_precision = mp
            self._init_sharding(mp, deepspeed_plugin, fsdp_plugin)
            # the layout always exists: data parallelism over the world until an Accelerator sets a parallel config
            self.parallel_layout = trivial_layout(self.num_processes, self.process_index,
                                                  self.distributed_type in (DistributedType.FSDP,
                                                                            DistributedType.DEEPSPEED),
                                                  self.device.type)

    @property
    def initialized_precision(self) -> bool:
        return "_mixed_precision" in self._shared_state

    @property
    def initialized(self) -> bool:
        return self._shared_state != {}

    def __reduce__(self) -> tuple:  # a view of this process's state (borg.py)
        return reduce_shared(self, *(() if type(self) is PartialState else (PartialState,)))

    def _init_sharding(self, mp: str, deepspeed_plugin: Any, fsdp_plugin: Any) -> None:
        """HF's choice of DEEPSPEED / FSDP, except that CPU processes shard too (HF runs them as plain DDP): a
        DeepSpeed plugin always makes the run DEEPSPEED (its JSON then owns fp16/bf16, as in HF); an FSDP plugin
        makes a multi-process run FSDP (one process stays NO, as HF's single-GPU run)."""
        if deepspeed_plugin is not None:
            plugins = list(deepspeed_plugin.values()) if isinstance(deepspeed_plugin, dict) else [deepspeed_plugin]
            for plugin in plugins:
                plugin.set_mixed_precision(mp)
            plugins[0].select(_from_accelerator_state=True)  # the first one is the active one
            self.deepspeed_plugins = deepspeed_plugin
            self.distributed_type = DistributedType.DEEPSPEED
            if mp != "fp8":
                self._mixed_precision = "no"  # read from the DeepSpeed config (the `mixed_precision` property)
        elif fsdp_plugin is not None and self.num_processes > 1:
            self.distributed_type = DistributedType.FSDP
            if mp != "no":
                fsdp_plugin.set_mixed_precision(mp)
            self.fsdp_plugin = fsdp_plugin
        if fsdp_plugin is not None and self.device.type == "cpu" and \
                type(getattr(fsdp_plugin, "cpu_offload", None)).__name__ == "CPUOffloadPolicy":
            warnings.warn("FullyShardedDataParallelPlugin(cpu_offload=True) / FSDP_OFFLOAD_PARAMS: this run is on CPU "
                          "already, so offloading to CPU is a no-op", UserWarning, stacklevel=4)
        PartialState._shared_state["distributed_type"] = self.distributed_type

    @property
    def mixed_precision(self) -> str:
        if self.distributed_type == DistributedType.DEEPSPEED and self._mixed_precision != "fp8":
            config = self.deepspeed_plugin.deepspeed_config
            if config.get("fp16", {}).get("enabled", False):
                return "fp16"
            if config.get("bf16", {}).get("enabled", False):
                return "bf16"
            return "no"
        return self._mixed_precision

    def __repr__(self) -> str:
        text = PartialState().__repr__() + f"\nMixed precision type: {self.mixed_precision}\n"
        if self.distributed_type == DistributedType.DEEPSPEED:
            text += f"ds_config: {self.deepspeed_plugin.deepspeed_config}\n"
        return text

    @staticmethod
    def _reset_state(reset_partial_state: bool = False) -> None:
        AcceleratorState._shared_state.clear()
        if reset_partial_state:
            PartialState._reset_state()

    # Process-level helpers delegate to PartialState.
    use_distributed = PartialState.use_distributed
    is_main_process = PartialState.is_main_process
    is_local_main_process = PartialState.is_local_main_process
    is_last_process = PartialState.is_last_process

    def wait_for_everyone(self) -> None:
        PartialState().wait_for_everyone()

    def split_between_processes(self, inputs: Any, apply_padding: bool = False):
        return PartialState().split_between_processes(inputs, apply_padding=apply_padding)

    def main_process_first(self):
        return PartialState().main_process_first()

    def local_main_process_first(self):
        return PartialState().local_main_process_first()

    def print(self, *args: Any, **kwargs: Any) -> None:
        PartialState().print(*args, **kwargs)

    def destroy_process_group(self, group: Any = None) -> None:
        PartialState().destroy_process_group(group)

    def __getattr__(self, name: str) -> Any:
        if name in self._known_attrs:
            raise AttributeError(_RESET_TEXT.format(cls="AcceleratorState", name=name))
        raise AttributeError(f"'AcceleratorState' object has no attribute '{name}'")
