# accelerate_c/base/parallelism_config.py: HF 1.15's ParallelismConfig face (`accelerate.parallelism_config`): the
# parallel degrees dp_replicate x dp_shard x cp x sp x tp, HF's fields, properties, PARALLELISM_CONFIG_* variable
# fallbacks, validation and error texts, plus `pp_size` of ours (PARALLELISM_CONFIG_PP_SIZE; the pipeline dimension
# is the outermost of the mesh). Two of HF's checks are relaxed (docs/differences.md): tp_size > 1 with pure
# replication (dp_replicate_size > 1, dp_shard_size == 1) is allowed (our DDP over TP slices), and the config is
# accepted on CPU processes and under FSDP of either version (`_validate_world`). What accelerate_c implements of a
# config (pp/cp/sp > 1 are refused) is decided where the layout is built (runtime/layout_build.py).
# Not for: the process groups, coordinates and data rule (runtime/layout.py) or the handlers (parallel_handlers.py).
from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass
from typing import Any, Literal, Optional, Union

from . import settings
from .parallel_handlers import DeepSpeedSequenceParallelConfig, TorchContextParallelConfig, TorchTensorParallelConfig

_ENV = "PARALLELISM_CONFIG_"
SIZE_FIELDS = ("dp_replicate_size", "dp_shard_size", "tp_size", "cp_size", "sp_size", "pp_size")
MESH_ORDER = ("pp", "dp_replicate", "dp_shard", "cp", "sp", "tp")  # outermost first (HF's order, pp in front)
PP_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1")  # pipeline/schedules.py builds each


def _size(name: str, value: Any) -> int:
    """A size field: unset -> its PARALLELISM_CONFIG_* variable (default 1); an explicit value must be an int."""
    if value is None:
        return settings.env_int(_ENV + name.upper(), default=1)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"ParallelismConfig.{name} must be an integer, got {value!r} ({type(value).__name__})")
    return value


@dataclass
class ParallelismConfig:
    """The parallel degrees of a run (HF 1.15's face, plus pp_size). Unset fields are read from the
    PARALLELISM_CONFIG_* variables (`launch --parallelism_config_*`), defaulting to 1 / "torch" / "deepspeed"."""

    dp_replicate_size: Optional[int] = None
    dp_shard_size: Optional[int] = None
    tp_size: Optional[int] = None
    cp_size: Optional[int] = None
    cp_backend: Literal["torch"] = None  # type: ignore[assignment]
    sp_size: Optional[int] = None
    sp_backend: Literal["deepspeed"] = None  # type: ignore[assignment]
    tp_handler: Union[None, TorchTensorParallelConfig] = None
    cp_handler: Union[None, TorchContextParallelConfig] = None
    sp_handler: Union[None, DeepSpeedSequenceParallelConfig] = None
    pp_size: Optional[int] = None  # ours, last so that HF's positional order is kept
    pp_schedule: Optional[str] = None           # ours: "gpipe", "1f1b" (default), "interleaved_1f1b", "zb_h1"
    pp_num_micro_batches: Optional[int] = None  # ours: micro-batches per batch (default: pp_size)
    pp_virtual_stages: Optional[int] = None     # ours: stages per rank of interleaved_1f1b (default 1)

    device_mesh = None  # (not a field) the torch DeviceMesh once get_device_mesh built it

    def __post_init__(self) -> None:
        for name in SIZE_FIELDS:
            setattr(self, name, _size(name, getattr(self, name)))
        if self.cp_backend is None:
            self.cp_backend = settings.env_value(_ENV + "CP_BACKEND", "torch")
        if self.sp_backend is None:
            self.sp_backend = settings.env_value(_ENV + "SP_BACKEND", "deepspeed")
        self._default_handlers()
        for name in ("dp_replicate_size", "dp_shard_size", "tp_size", "cp_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, but got {getattr(self, name)}")
        if self.cp_backend not in ["torch"]:
            raise ValueError(f"cp_backend must be one of ['torch'], but got {self.cp_backend}")
        if self.sp_size < 1:
            raise ValueError(f"sp_size must be at least 1, but got {self.sp_size}")
        if self.sp_backend not in ["deepspeed"]:
            raise ValueError(f"sp_backend must be one of ['deepspeed'], but got {self.sp_backend}")
        if self.pp_size < 1:
            raise ValueError(f"pp_size must be at least 1, but got {self.pp_size}")
        self._pipeline_fields()
        if self.cp_size > 1 and self.sp_size > 1:
            raise ValueError("Context Parallelism (CP) and Sequence Parallelism (SP) are mutually exclusive. "
                             f"Got cp_size={self.cp_size} and sp_size={self.sp_size}. "
                             "Please set either cp_size=1 or sp_size=1.")
        # HF also refuses tp_size > 1 here; accelerate_c runs DDP over the TP slices (docs/differences.md)
        if self.cp_size > 1 and self.dp_replicate_size > 1 and self.dp_shard_size == 1:
            raise ValueError(
                "Tensor/Context parallelism (tp/cp_size > 1) cannot be used with pure data parallelism "
                "(dp_replicate_size > 1 and dp_shard_size == 1). Please set dp_shard_size > 1 and dp_replicate_size "
                "== 1 to compose FSDP + TP/CP for 2D parallel, or set dp_replicate_size == 1 and dp_shard_size > 1 "
                "to compose HSDP + TP/CP for 3D parallel.")
        self._sizes = {"dp_replicate": self.dp_replicate_size, "dp_shard": self.dp_shard_size, "tp": self.tp_size,
                       "cp": self.cp_size, "sp": self.sp_size, "pp": self.pp_size}

    def _pipeline_fields(self) -> None:
        """pp_schedule / pp_num_micro_batches / pp_virtual_stages (ours): unset -> PARALLELISM_CONFIG_PP_* (default
        "1f1b", pp_size, 1); a bad value is an error naming the field."""
        if self.pp_schedule is None:
            self.pp_schedule = settings.env_value(_ENV + "PP_SCHEDULE", "1f1b")
        if self.pp_schedule not in PP_SCHEDULES:
            raise ValueError(f"pp_schedule must be one of {list(PP_SCHEDULES)}, but got {self.pp_schedule!r}")
        if self.pp_num_micro_batches is None:
            self.pp_num_micro_batches = settings.env_int(_ENV + "PP_NUM_MICRO_BATCHES", default=self.pp_size)
        if self.pp_virtual_stages is None:
            self.pp_virtual_stages = settings.env_int(_ENV + "PP_VIRTUAL_STAGES", default=1)
        for name in ("pp_num_micro_batches", "pp_virtual_stages"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an integer of at least 1, but got {v!r}")
        if self.pp_virtual_stages > 1 and self.pp_schedule != "interleaved_1f1b":
            raise ValueError(f"pp_virtual_stages={self.pp_virtual_stages} needs pp_schedule='interleaved_1f1b', "
                             f"got {self.pp_schedule!r}")

    def _default_handlers(self) -> None:
        """HF: a default handler for each enabled dimension; a cp_handler of the wrong class is an error."""
        if self.tp_size > 1 and self.tp_handler is None:
            self.tp_handler = TorchTensorParallelConfig()
        if self.cp_size > 1:
            if self.cp_handler is None:
                self.cp_handler = TorchContextParallelConfig()
            elif self.cp_backend == "torch" and not isinstance(self.cp_handler, TorchContextParallelConfig):
                raise ValueError(f"ParallelismConfig's cp_backend={self.cp_backend} requires "
                                 f"{TorchContextParallelConfig}, but cp_handler was set to {type(self.cp_handler)}")
        if self.sp_size > 1 and self.sp_handler is None:
            self.sp_handler = DeepSpeedSequenceParallelConfig()

    def __repr__(self) -> str:
        pp = (f"\tpp_size={self.pp_size},\n\tpp_schedule={self.pp_schedule},\n\tpp_num_micro_batches="
              f"{self.pp_num_micro_batches},\n\tpp_virtual_stages={self.pp_virtual_stages},\n"
              if self.pp_size != 1 else "")
        return ("ParallelismConfig(\n "
                f"\tdp_replicate_size={self.dp_replicate_size},\n\tdp_shard_size={self.dp_shard_size},\n"
                f"\ttp_size={self.tp_size},\n\tcp_size={self.cp_size},\n\tcp_backend={self.cp_backend},\n"
                f"\tsp_size={self.sp_size},\n\tsp_backend={self.sp_backend},\n{pp}\ttotal_size={self.total_size}\n"
                f"\ttp_handler={self.tp_handler},\n\tcp_handler={self.cp_handler})\n")

    def to_json(self) -> dict[str, Any]:
        """The settings as a JSON-ready dict (handlers as their field dicts). HF 1.15 builds it and returns None."""
        out = {}
        for k, v in self.__dict__.items():
            if k == "device_mesh" or k.startswith("_"):
                continue
            out[k] = copy.deepcopy(v.__dict__) if hasattr(v, "__dict__") else v
        return out

    # -- HF's properties ------------------------------------------------------------------------------------------
    @property
    def dp_dim_names(self) -> list[str]:
        """Enabled dimensions across which data parallelism is applied."""
        return [n for n, on in (("dp_replicate", self.dp_replicate_enabled), ("dp_shard", self.dp_shard_enabled)) if on]

    @property
    def non_dp_dim_names(self) -> list[str]:
        """Enabled dimensions whose ranks receive the same batch (pp first, then HF's tp, cp, sp)."""
        return [n for n, on in (("pp", self.pp_enabled), ("tp", self.tp_enabled), ("cp", self.cp_enabled),
                                ("sp", self.sp_enabled)) if on]

    @property
    def dp_shard_cp_dim_names(self) -> list[str]:
        """Enabled dimensions flattened into the joint mesh that FSDP shards the model over."""
        return [n for n, on in (("dp_shard", self.dp_shard_enabled), ("cp", self.cp_enabled)) if on]

    @property
    def dp_cp_dim_names(self) -> list[str]:
        """Enabled dimensions over which the loss is averaged."""
        return self.dp_dim_names + (["cp"] if self.cp_enabled else [])

    @property
    def fsdp_dim_names(self) -> list[str]:
        """Dimensions FSDP is applied across, data-parallel replication included."""
        return (["dp_replicate"] if self.dp_replicate_enabled else []) + ["dp_shard_cp"]

    @property
    def total_size(self) -> int:
        """The product of every size (pp_size included)."""
        return (self.dp_replicate_size * self.dp_shard_size * self.tp_size * self.cp_size * self.sp_size
                * self.pp_size)

    @property
    def non_data_parallel_size(self) -> int:
        """The product of the sizes of the dimensions that receive the same batch."""
        return self.tp_size * self.cp_size * self.sp_size * self.pp_size

    @property
    def data_parallel_size(self) -> int:
        """dp_replicate_size x dp_shard_size."""
        return self.dp_replicate_size * self.dp_shard_size

    @property
    def dp_replicate_enabled(self) -> bool:
        return self.dp_replicate_size > 1

    @property
    def dp_shard_enabled(self) -> bool:
        return self.dp_shard_size > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp_size > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp_size > 1

    @property
    def sp_enabled(self) -> bool:
        return self.sp_size > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp_size > 1

    @property
    def active_mesh_dims(self) -> list[str]:
        return self.dp_dim_names + self.non_dp_dim_names

    # -- the device mesh -------------------------------------------------------------------------------------------
    def _get_mesh(self) -> tuple:
        """(mesh_dim_names, mesh_shape) of the enabled dimensions in mesh order; () when none is enabled."""
        sizes = {n: self._sizes[n] for n in self.active_mesh_dims}
        items = sorted(sizes.items(), key=lambda kv: MESH_ORDER.index(kv[0]))
        return tuple(zip(*items))

    def build_device_mesh(self, device_type: str) -> Any:
        """A torch DeviceMesh over the enabled dimensions (HF's names and order, pp outermost) with HF's flattened
        dimensions "dp", "dp_shard_cp" and "dp_cp". Collective: every rank must call it. None when no dimension is
        enabled or under DeepSpeed's sequence parallelism (HF's rule)."""
        if self.sp_backend == "deepspeed" and self.sp_size > 1:
            return None
        from torch.distributed.device_mesh import init_device_mesh

        mesh = self._get_mesh()
        if len(mesh) == 0:
            return None
        names, shape = mesh
        device_mesh = init_device_mesh(device_type, shape, mesh_dim_names=names)
        for flat, dims in (("dp", self.dp_dim_names), ("dp_shard_cp", self.dp_shard_cp_dim_names),
                           ("dp_cp", self.dp_cp_dim_names)):
            if dims:
                device_mesh[tuple(dims)]._flatten(flat)
        return device_mesh

    def get_device_mesh(self, device_type: Optional[str] = None) -> Any:
        if self.device_mesh is None:
            if device_type is None:
                raise ValueError("You need to pass a device_type e.g cuda to build the device mesh")
            self.device_mesh = self.build_device_mesh(device_type)
        elif device_type is not None and self.device_mesh.device_type != device_type:
            raise ValueError(
                f"The device_mesh is already created with device type {self.device_mesh.device_type}. However, you "
                f"are trying to get a device mesh with device_type {device_type}. Please check if you correctly "
                "initialized your device_mesh")
        return self.device_mesh

    def _set_size(self, parallelism: str, size: int) -> None:
        if parallelism not in self._sizes:
            raise ValueError(f"Parallelism must be one of {self._sizes.keys()}")
        self._sizes[parallelism] = size
        setattr(self, f"{parallelism}_size", size)

    # -- against the run -------------------------------------------------------------------------------------------
    def _validate_accelerator(self, accelerator: Any) -> None:
        """HF's check of the config against an Accelerator (relaxed: see `_validate_world`)."""
        self._validate_world(accelerator.num_processes, str(getattr(accelerator.distributed_type, "value",
                                                                        accelerator.distributed_type)),
                             accelerator.is_main_process)

    def _validate_world(self, num_processes: int, distributed_type: str, is_main_process: bool = True) -> None:
        """HF's checks against the run, with HF's texts: a config of total size 1 on several processes becomes
        dp_replicate = the number of processes; the product of the sizes must be the number of processes; FSDP
        needs a dimension to shard over. Relaxed: MULTI_CPU processes and FSDP of either version are accepted (HF
        wants FSDP2, DeepSpeed or several GPUs)."""
        if num_processes == 1 and self.total_size == 1:
            return
        if self.total_size == 1:
            self._set_size("dp_replicate", num_processes)
        if not (self.sp_backend == "deepspeed" and self.sp_size > 1) and self.total_size != num_processes:
            raise ValueError(f"ParallelismConfig total_size ({self.total_size}) does not match num_processes "
                             f"({num_processes}). Please adjust dp_replicate_size/ dp_shard_size/tp_size/cp_size/"
                             "sp_size.")
        if distributed_type == "FSDP" and not self.dp_shard_enabled and not self.cp_enabled:
            raise ValueError(
                "FSDP is enabled but the parallelism config has no dimension for FSDP to shard across (both "
                "`dp_shard_size` and `cp_size` are 1). This usually means a model that is already parallelized "
                "another way -- e.g. loaded with `DistributedConfig(tp_size=N)` or `enable_expert_parallel=True`, "
                "which makes the whole world size tensor/expert parallel -- was launched under an FSDP config. "
                "Either launch it without the FSDP config, or leave ranks for FSDP to use by lowering `tp_size`.")
        unused = [f"ParallelismConfig.{p}_handler is set, but {p}_size is set to 1. This handler will be ignored."
                  for p, size in self._sizes.items() if size == 1 and getattr(self, f"{p}_handler", None) is not None]
        if unused and is_main_process:
            warnings.warn("ParallelismConfig has the following warnings:\n" + "\n".join(sorted(unused)), UserWarning)
