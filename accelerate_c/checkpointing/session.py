# accelerate_c/checkpointing/session.py: `Accelerator.save_state` under any strategy and world size (universal
# checkpoints: logical tensors, loadable by any other strategy/world size; the load is loading.py).
#
# Layout of one checkpoint directory (JSON + safetensors, never pickle):
#   checkpoint.json                      format/version, world size, step, file sizes; written last by the main
#                                        process, so its presence marks a complete checkpoint
#   model.json, model_1.json...          per model: index of logical tensors -> pieces (universal.py)
#   model[-rankR-of-W].safetensors       per model and rank: the pieces that rank owns (pieces.py); one process:
#                                        model.safetensors, a plain state-dict file (tied weights stored once)
#   optimizer.json, optimizer[-rankR-of-W].safetensors ...   the same for optimizers (groups by parameter name)
#   scheduler[_i].json, scaler.json, custom_checkpoint_{i}.json   written by the main process
#   random_states_{rank}.json/.safetensors        per rank: python/numpy/torch(/cuda) RNG and the step
#   dataloader_states_{rank}.json/.safetensors    per rank: state_dict() of every prepared dataloader
#   fp8_states_{rank}.json               per rank, fp8 runs: FP8Linear amax histories (scaling.py)
# Coordination (only is_main_process, process_index, num_processes, wait_for_everyone() are used):
#   main creates the temp dir -> barrier -> every rank writes its files in parallel -> barrier -> every rank
#   reads the pieces' headers and builds the same indexes (so a bad layout fails on every rank alike) -> main
#   writes the indexes and checkpoint.json and commits (atomic.py) -> barrier.
# Different world size or strategy at load: model and optimizer are read range by range into this rank's slices
# (the strategy's model_slices / optimizer_layout); scheduler/scaler/custom state load fully;
# rank r restores random_states_r when it exists, else keeps its current RNG (a warning names the rank);
# stateful dataloaders get rank r's state, or rank 0's when rank r has none (the loader must re-map it).
# Not for: loading (loading.py), finding, naming and rotating checkpoints (directory.py), the piece files
# (pieces.py), the meaning of the pieces (universal.py), which rank writes what (layout.py), the RNG (rng.py).
from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass
from typing import Any, Optional

import torch

from . import atomic
from . import scaling
from . import universal
from .agreement import agree
from .directory import (CHECKPOINT_FILE, CHECKPOINT_FORMAT, CHECKPOINT_VERSION, clear_interrupted, is_coordinator,
                        listed_files, output_dir_for, rotate)
from .errors import CheckpointError
from .format import write_json, write_state
from .layout import strategy_of
from .pieces import rank_file, read_rank_meta, write_rank_file
from .rng import rng_state
from .universal import user_model as _user_model

logger = logging.getLogger(__name__)

def _nth(base: str, i: int) -> str:
    return base if i == 0 else f"{base}_{i}"


def _model_of(accelerator: Any, optimizer: Any) -> Any:
    """The prepared model whose parameters the optimizer steps; when it spans several models or steps tensors of
    no prepared model, one module holding them all ("<model index>.<name>", "loose.<i>")."""
    owner = getattr(strategy_of(accelerator), "optimizer_model", lambda o: None)(optimizer)
    if owner is not None:
        return owner
    params = [p for g in getattr(optimizer, "optimizer", optimizer).param_groups for p in g["params"]]
    ids = {id(p) for p in params}
    models = [_user_model(m) for m in accelerator._models]
    for m in models:
        if ids <= {id(p) for p in m.parameters()}:
            return m
    holder = torch.nn.ModuleList(models)
    known = {id(p) for m in models for p in m.parameters()}
    loose = [p for p in params if id(p) not in known and isinstance(p, torch.nn.Parameter)]
    if loose:
        holder.loose = torch.nn.ParameterList(loose)
    return holder


def _state_dict_or_none(obj: Any) -> Any:
    fn = getattr(obj, "state_dict", None)
    return fn() if callable(fn) else None


# ---------------------------------------------------------------------------------------------------- save
@dataclass
class _Collected:
    """What a save reads from the run besides the model and optimizer pieces (every rank)."""
    schedulers: list
    custom: list
    scaler: Any
    rng: dict
    dataloaders: list


def save_state(accelerator: Any, output_dir: Optional[str] = None, safe_serialization: bool = True,
               **save_model_func_kwargs: Any) -> str:
    """Saves models, optimizers, schedulers, scaler, custom objects, every rank's RNG and data position and
    the step to output_dir (or `{project_dir}/checkpoints/checkpoint_{iteration}`); returns the path.
    Must be called on every process. `safe_serialization=False` is accepted but weights stay safetensors."""
    pc = accelerator.project_configuration
    coord = is_coordinator(accelerator)
    output_dir, auto_root = output_dir_for(pc, output_dir)
    if not safe_serialization:
        logger.info("accelerate_c checkpoints never pickle: model weights are written as safetensors anyway")
    if save_model_func_kwargs:  # HF hands them to DeepSpeed's save_checkpoint; our checkpoint has no such options
        logger.warning("save_state: these keywords have no effect in accelerate_c (HF passes them to DeepSpeed's "
                       "save_checkpoint): %s", ", ".join(sorted(save_model_func_kwargs)))
    tmp = _open_temp_dir(accelerator, coord, output_dir, auto_root)
    # Every rank writes the model/optimizer pieces it owns (no gather), its RNG and its data position.
    strategy = strategy_of(accelerator)
    _run_save_hooks(accelerator, strategy, tmp)
    names = _write_pieces(accelerator, strategy, tmp)
    collected = _collect(accelerator)
    has_fp8 = _write_rank_state(accelerator, tmp, collected)
    if coord:
        _write_shared(tmp, collected)
    accelerator.wait_for_everyone()
    # Every rank builds the indexes from the headers (small reads), so a bad layout raises on every rank.
    indexes = _build_indexes(tmp, names, int(accelerator.num_processes))
    accelerator.wait_for_everyone()
    if coord:
        _publish(accelerator, tmp, output_dir, indexes, _contents(names, collected, has_fp8))
        if auto_root is not None:
            rotate(auto_root, pc.total_limit)
    accelerator.wait_for_everyone()
    pc.iteration += 1
    return output_dir


def _open_temp_dir(accelerator: Any, coord: bool, output_dir: str, auto_root: Optional[str]) -> str:
    """The coordinator clears interrupted saves and creates the temp dir every rank writes into (then a barrier)."""
    tmp = atomic.temp_dir_for(output_dir)
    if coord:
        if auto_root is not None:
            clear_interrupted(auto_root)
        atomic.prepare_temp_dir(output_dir, CHECKPOINT_FILE)
    accelerator.wait_for_everyone()
    # one checkpoint that every rank writes into: a rank given another directory (or one on a file system the main
    # process does not share) would fail later, alone and obscurely; all ranks stop here, and nothing is left behind
    error = None if os.path.isdir(tmp) else CheckpointError(
        f"save_state: output_dir {output_dir!r} on this rank is not the directory the main process is writing "
        f"(no {os.path.basename(tmp)!r} in it): give every rank the same output_dir, on a file system all ranks see")
    try:
        agree(accelerator, error, "save_state", "nothing was saved")
    except BaseException:
        if coord:
            atomic.release(tmp)
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return tmp


def _run_save_hooks(accelerator: Any, strategy: Any, tmp: str) -> None:
    """The save_model_state_pre_hooks, given the models, their weights and the temp dir."""
    if not accelerator._save_model_state_pre_hook:
        return
    # (HF: no weights where its FSDP / DeepSpeed engine saves the models; get_state_dict is then rank 0's alone)
    weights = ([] if strategy.hooks_get_no_weights()
               else [accelerator.get_state_dict(m) for m in accelerator._models])
    for hook in accelerator._save_model_state_pre_hook.values():
        hook(list(accelerator._models), weights, tmp)


def _write_pieces(accelerator: Any, strategy: Any, tmp: str) -> tuple[list[str], list[str]]:
    """This rank's file of every model and optimizer (the slices it owns); returns (model names, optimizer names)."""
    rank, world = int(accelerator.process_index), int(accelerator.num_processes)
    model_names = [_nth("model", i) for i in range(len(accelerator._models))]
    opt_names = [_nth("optimizer", i) for i in range(len(accelerator._optimizers))]
    for name, m in zip(model_names, accelerator._models):
        pieces, extra, pmeta = universal.model_rank_part(strategy.model_slices(_user_model(m)))
        write_rank_file(os.path.join(tmp, rank_file(name, rank, world)), pieces, extra, pmeta)
    for name, opt in zip(opt_names, accelerator._optimizers):
        slots = strategy.optimizer_layout(opt, _model_of(accelerator, opt))
        pieces, extra, pmeta = universal.optimizer_rank_part(opt.state_dict(), slots)
        write_rank_file(os.path.join(tmp, rank_file(name, rank, world)), pieces, extra, pmeta)
    return model_names, opt_names


def _collect(accelerator: Any) -> _Collected:
    schedulers = [s.state_dict() for s in accelerator._schedulers]
    custom = [obj.state_dict() for obj in accelerator._custom_objects]
    scaler = getattr(accelerator, "scaler", None)
    rng = rng_state()
    rng["step"] = int(accelerator.step)
    return _Collected(schedulers, custom, scaler, rng, [_state_dict_or_none(dl) for dl in accelerator._dataloaders])


def _write_rank_state(accelerator: Any, tmp: str, collected: _Collected) -> bool:
    """This rank's RNG, data position and fp8 scaling files; True when there were fp8 histories to save."""
    rank = int(accelerator.process_index)
    write_state(tmp, f"random_states_{rank}", collected.rng, kind="rng")
    write_state(tmp, f"dataloader_states_{rank}", collected.dataloaders, kind="dataloaders")
    return scaling.save_scaling(accelerator, tmp, rank)


def _write_shared(tmp: str, collected: _Collected) -> None:
    """The files one process writes: schedulers, custom objects, the GradScaler."""
    for i, st in enumerate(collected.schedulers):
        write_state(tmp, _nth("scheduler", i), st, kind="scheduler")
    for i, st in enumerate(collected.custom):
        write_state(tmp, f"custom_checkpoint_{i}", st, kind="custom")
    if collected.scaler is not None:
        write_state(tmp, "scaler", collected.scaler.state_dict(), kind="scaler")


def _contents(names: tuple[list[str], list[str]], collected: _Collected, has_fp8: bool) -> dict[str, Any]:
    """checkpoint.json's list of what the checkpoint holds."""
    model_names, opt_names = names
    return {
        "models": model_names,
        "optimizers": opt_names,
        "schedulers": [_nth("scheduler", i) for i in range(len(collected.schedulers))],
        "custom_objects": [f"custom_checkpoint_{i}" for i in range(len(collected.custom))],
        "scaler": "scaler" if collected.scaler is not None else None,
        scaling.META_KEY: has_fp8,
        "num_dataloaders": len(collected.dataloaders),
        "data_position": [{k: st.get(k) for k in ("epoch", "batches_consumed", "samples_consumed")}
                          if isinstance(st, dict) else None for st in collected.dataloaders],
    }


def _build_indexes(tmp: str, names: tuple[list[str], list[str]], world: int) -> dict[str, dict]:
    """The index of every model and optimizer, from every rank's file headers."""
    indexes = {}
    for group, build in zip(names, (universal.model_index, universal.optimizer_index)):
        for name in group:
            files = [rank_file(name, r, world) for r in range(world)]
            indexes[name] = build(tmp, files, [read_rank_meta(os.path.join(tmp, f)) for f in files])
    return indexes


def _publish(accelerator: Any, tmp: str, output_dir: str, indexes: dict[str, dict], contents: dict) -> None:
    """The coordinator writes the indexes and checkpoint.json (last) and commits the temp dir to output_dir."""
    for name, doc in indexes.items():
        write_json(os.path.join(tmp, f"{name}.json"), doc)
    old_files = listed_files(output_dir)
    files = {n: os.path.getsize(os.path.join(tmp, n)) for n in sorted(os.listdir(tmp))
             if os.path.isfile(os.path.join(tmp, n))}
    meta = {"format": CHECKPOINT_FORMAT, "version": CHECKPOINT_VERSION,
            "world_size": int(accelerator.num_processes), "step": int(accelerator.step),
            "iteration": int(accelerator.project_configuration.iteration), "torch_version": torch.__version__,
            **contents, "files": files}
    write_json(os.path.join(tmp, CHECKPOINT_FILE), meta)
    atomic.commit(tmp, output_dir, CHECKPOINT_FILE, drop_from_old=old_files + [CHECKPOINT_FILE])
