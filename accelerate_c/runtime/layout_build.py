# accelerate_c/runtime/layout_build.py: the one place a run's parallel layout is decided, once, from the user's
# ParallelismConfig or MegatronLMPlugin (at most one of them) and the world: HF's checks against the world
# (ParallelismConfig._validate_world, HF's error texts), what accelerate_c implements (context parallelism and
# DeepSpeed-Ulysses sequence parallelism are refused with a NotImplementedError naming them), the Megatron-LM
# mapping (tp_degree -> tp, pp_degree -> pp, num_micro_batches, the rest of the world data-parallel), then the
# ParallelLayout with its process groups made (collective over every rank when a config asks for more than data
# parallelism).
# The data-parallel dimension of a layout that does not say which (the trivial one, Megatron-LM's) is dp_shard
# under FSDP / DeepSpeed (`sharded`) and dp_replicate otherwise.
# Not for: the layout object itself (layout.py) or the faces (base/parallelism_config.py, base/megatron_plugin.py).
from __future__ import annotations

from typing import Any, Optional

from .layout import Degrees, ParallelLayout


def trivial_layout(num_processes: int, process_index: int, sharded: bool = False,
                   device_type: str = "cpu") -> ParallelLayout:
    """Data parallelism over the whole world, nothing else (no collective)."""
    degrees = Degrees(dp_shard=num_processes) if sharded else Degrees(dp_replicate=num_processes)
    return ParallelLayout(degrees, process_index, device_type=device_type)


def refuse_unimplemented(cp: int, sp: int) -> None:
    """cp / sp > 1: a NotImplementedError naming the dimension and the field that asked for it."""
    if cp > 1:
        raise NotImplementedError(f"context parallelism (ParallelismConfig.cp_size={cp}) is not implemented yet in "
                                  "accelerate_c; use cp_size=1")
    if sp > 1:
        raise NotImplementedError(
            f"DeepSpeed (ALST/Ulysses) sequence parallelism (ParallelismConfig.sp_size={sp}) is not implemented in "
            "accelerate_c; use sp_size=1 (Megatron-style sequence parallelism over the TP group: "
            "MegatronLMPlugin(tp_degree=..., sequence_parallelism=True))")


def _from_parallelism_config(pc: Any, num_processes: int, distributed_type: str, is_main: bool) -> Degrees:
    refuse_unimplemented(pc.cp_size, pc.sp_size)
    pc._validate_world(num_processes, distributed_type, is_main)
    return Degrees(pp=pc.pp_size, dp_replicate=pc.dp_replicate_size, dp_shard=pc.dp_shard_size, cp=pc.cp_size,
                   tp=pc.tp_size)


def _from_megatron(plugin: Any, num_processes: int, sharded: bool) -> Degrees:
    tp, pp = plugin.tp_degree, plugin.pp_degree
    if num_processes % (tp * pp):
        raise ValueError(f"MegatronLMPlugin: tp_degree ({tp}) x pp_degree ({pp}) = {tp * pp} does not divide the "
                         f"number of processes ({num_processes}); the data-parallel degree is processes / (tp x pp)")
    dp = num_processes // (tp * pp)
    return Degrees(pp=pp, tp=tp, **({"dp_shard": dp} if sharded else {"dp_replicate": dp}))


def decide(parallelism_config: Optional[Any], megatron_lm_plugin: Optional[Any], num_processes: int,
           distributed_type: str, is_main_process: bool = True) -> tuple[Optional[Degrees], dict[str, Any]]:
    """The degrees a config or plugin asks for, validated against the world (None without either), and the
    layout's other settings. No collective: the launcher calls it too, on the variables the ranks will read."""
    sharded = distributed_type in ("FSDP", "DEEPSPEED")
    if parallelism_config is not None and megatron_lm_plugin is not None:
        raise ValueError("Accelerator: pass either a ParallelismConfig (parallelism_config=, "
                         "ACCELERATE_USE_PARALLELISM_CONFIG) or a MegatronLMPlugin (megatron_lm_plugin=, "
                         "ACCELERATE_USE_MEGATRON_LM), not both: they describe the same layout")
    if parallelism_config is not None:
        degrees = _from_parallelism_config(parallelism_config, num_processes, distributed_type, is_main_process)
        return degrees, dict(mesh_config=parallelism_config, source="parallelism_config",
                             num_micro_batches=parallelism_config.pp_num_micro_batches,
                             pp_schedule=parallelism_config.pp_schedule,
                             pp_virtual_stages=parallelism_config.pp_virtual_stages)
    if megatron_lm_plugin is not None:
        if distributed_type == "DEEPSPEED":
            raise ValueError("MegatronLMPlugin cannot be combined with DeepSpeed in accelerate_c: use "
                             "ParallelismConfig(tp_size=...) with the DeepSpeedPlugin, or MegatronLMPlugin with "
                             "data parallelism or FSDP")
        degrees = _from_megatron(megatron_lm_plugin, num_processes, sharded)
        return degrees, dict(sequence_parallel=megatron_lm_plugin.sequence_parallelism,
                             num_micro_batches=megatron_lm_plugin.num_micro_batches,
                             gradient_clipping=megatron_lm_plugin.clip_norm, source="megatron_lm")
    return None, {}


def build_layout(parallelism_config: Optional[Any], megatron_lm_plugin: Optional[Any], *, num_processes: int,
                 process_index: int, distributed_type: str, device_type: str = "cpu",
                 is_main_process: bool = True) -> ParallelLayout:
    """The run's ParallelLayout. `distributed_type` is the state's (its value, e.g. "FSDP"): FSDP / DEEPSPEED make
    the implicit data-parallel dimension dp_shard. Collective (the process groups) when the layout is not trivial."""
    degrees, extra = decide(parallelism_config, megatron_lm_plugin, num_processes, distributed_type,
                            is_main_process)
    if degrees is None:
        return trivial_layout(num_processes, process_index, distributed_type in ("FSDP", "DEEPSPEED"), device_type)
    layout = ParallelLayout(degrees, process_index, device_type=device_type, **extra)
    layout.build_groups()
    return layout
