# accelerate_c/checkpointing/loading.py: `Accelerator.load_state`, all or nothing and agreed across ranks.
#
# 1. plan: every rank reads and validates everything it will need, changing nothing: checkpoint.json (schema.py),
#    every file it lists (a regular file inside the checkpoint, of the listed size: files.py), the model and
#    optimizer indexes and the headers of every piece file they name (pieces.py: dtypes, element counts, pieces
#    that tile each tensor), this model's names and shapes and this optimizer's groups against them
#    (universal.py), and the small states in full: schedulers, scaler, this rank's RNG (tried on scratch
#    generators), dataloader positions, fp8 histories, custom objects.
# 2. agree (agreement.py): one collective; if any rank failed, every rank raises the same CheckpointError.
# 3. small states: applied with a snapshot of each object; agree again, and on any failure every rank puts its
#    snapshots back and raises.
# 4. tensors: model ranges are read straight into the live tensors (after 1-3 only an I/O error can stop a read),
#    agree again, then the strategies' post-load collectives (ZeRO re-gathers) and the optimizers' state.
# Different world size or strategy: see session.py's header. Not for: saving (session.py), the formats.
from __future__ import annotations

import inspect
import json
import logging
import os
import random
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import numpy as np
import torch

from . import scaling, schema, universal
from .agreement import agree
from .directory import input_dir_for, read_checkpoint_info
from .files import member, open_regular
from .format import CheckpointError, check_format, read_json, read_state
from .layout import strategy_of
from .pieces import PieceReader, rank_file, rank_meta
from .rng import rng_state, set_rng_state
from .session import _model_of, _state_dict_or_none
from .universal import user_model as _user_model

logger = logging.getLogger(__name__)

_CUSTOM_RE = re.compile(r"^custom_checkpoint_(\d+)\.json$")


@dataclass
class _Plan:
    """Everything a load applies, validated (phase 1)."""
    models: list = field(default_factory=list)        # (prepared model, target module, index, reader, slices)
    optimizers: list = field(default_factory=list)    # universal.OptimizerLoad
    schedulers: list = field(default_factory=list)   # (file name, state) pairs, as scaler and custom
    scaler: Any = None
    rng: Optional[dict] = None
    dataloaders: Optional[list] = None
    fp8: Optional[list] = None
    custom: list = field(default_factory=list)
    step: int = 0
    input_dir: str = ""
    strict: bool = True


def load_state(accelerator: Any, input_dir: Optional[str] = None, load_kwargs: Optional[dict] = None,
               **load_model_func_kwargs: Any) -> str:
    """Restores what save_state wrote (this rank's RNG only); returns the directory read.
    map_location (None/"cpu"/"on_device") picks where optimizer tensors are materialised; other keyword
    arguments go to `load_state_dict` of the models (e.g. strict=False). load_kwargs is accepted for HF
    compatibility and unused (there is no torch.load). On any error nothing is changed, on any rank."""
    input_dir = input_dir_for(accelerator.project_configuration, input_dir)
    device = _optimizer_device(accelerator, load_model_func_kwargs.pop("map_location", None))
    what = f"load_state({input_dir})"
    readers: list[PieceReader] = []
    try:
        plan, error = None, None
        try:
            plan = _plan(accelerator, input_dir, load_model_func_kwargs, device, readers)
        except Exception as e:   # every rank must reach the agreement, whatever stopped this one
            error = e
        agree(accelerator, error, what)
        undo, error = _apply_small(accelerator, plan)
        try:
            agree(accelerator, error, what)
        except BaseException:
            undo()
            raise
        _apply_tensors(accelerator, plan, load_model_func_kwargs, what)
    finally:
        for r in readers:
            r.close()
    return input_dir


def _optimizer_device(accelerator: Any, map_location: Optional[str]) -> Optional[str]:
    """Where optimizer tensors are materialised: None for the CPU (where they are read), else the device."""
    if map_location not in (None, "cpu", "on_device"):
        raise TypeError("Unsupported optimizer map location passed, please choose one of `None`, `'cpu'`, "
                        "or `'on_device'`")
    device = str(getattr(accelerator, "device", "cpu")) if map_location == "on_device" else "cpu"
    return device if device != "cpu" else None


# ---------------------------------------------------------------------------------------------- 1. plan
def _plan(accelerator: Any, input_dir: str, kwargs: dict, device: Optional[str], readers: list) -> _Plan:
    meta = read_checkpoint_info(input_dir)
    sizes = meta["files"]
    _check_listed(input_dir, sizes)
    saved_world, world = meta["world_size"], int(accelerator.num_processes)
    if saved_world != world and accelerator.is_main_process:
        _warn_world_change(input_dir, saved_world, world)
    models = _run_load_hooks(accelerator, input_dir, meta)
    strategy = strategy_of(accelerator)
    plan = _Plan(step=meta["step"], input_dir=input_dir, strict=kwargs.get("strict", True))
    for model, name in zip(models, meta["models"]):
        index, reader = _read_index(input_dir, name, universal.MODEL_INDEX, schema.MODEL_INDEX, meta, readers)
        target = accelerator.unwrap_model(model, keep_torch_compile=False)
        slices = strategy.model_slices(_user_model(model))
        universal.check_model(index, target, slices, strict=kwargs.get("strict", True))
        plan.models.append((model, target, index, reader, slices))
    _need(input_dir, "optimizer", accelerator._optimizers, meta["optimizers"])
    for opt, name in zip(accelerator._optimizers, meta["optimizers"]):
        index, reader = _read_index(input_dir, name, universal.OPTIMIZER_INDEX, schema.OPTIMIZER_INDEX, meta,
                                    readers)
        slots = strategy.optimizer_layout(opt, _model_of(accelerator, opt))
        plan.optimizers.append(universal.plan_optimizer(reader, index, opt, slots, device=device))
    _plan_small(accelerator, plan, input_dir, meta)
    return plan


def _check_listed(input_dir: str, sizes: dict) -> None:
    """Every file checkpoint.json lists is there, a regular file (not a link) of the listed size."""
    where = f"checkpoint file {os.path.join(input_dir, 'checkpoint.json')}"
    for name, size in sizes.items():
        os.close(open_regular(member(input_dir, name, where), size))


def _warn_world_change(input_dir: str, saved_world: Any, world: Any) -> None:
    logger.warning(
        "Checkpoint %s was saved by %s processes and is loaded by %s. Model, optimizer, scheduler, scaler "
        "and custom objects are restored in full. RNG: rank r reads random_states_r; ranks >= %s have no "
        "saved RNG and keep their current state; fp8 amax histories: rank r reads saved rank r %% %s. "
        "Data position: rank r's dataloader state (rank 0's for "
        "ranks without one) is handed to the dataloader, which must re-map it to the new world size.",
        input_dir, saved_world, world, saved_world, saved_world)


def _need(input_dir: str, kind: str, objs: list, names: list) -> None:
    if len(objs) > len(names):
        raise CheckpointError(f"{input_dir} holds {len(names)} {kind} state(s), {len(objs)} to load")


def _read_index(directory: str, name: str, fmt: str, spec: Any, meta: dict,
                readers: list) -> tuple[dict, PieceReader]:
    """A model or optimizer index and its validated reader (pieces.py). The index must be exactly what the piece
    files' own headers describe (rebuilt from them as the save did): an index edited by hand or mixed from two
    checkpoints is refused. Each piece file is opened and its header parsed once (the reader keeps it open)."""
    path = member(directory, name, f"checkpoint file {os.path.join(directory, 'checkpoint.json')}", ".json")
    doc = check_format(path, read_json(path, meta["files"].get(f"{name}.json")), fmt, universal.INDEX_VERSION,
                       "tensor index")
    schema.check(doc, spec, path)
    reader = PieceReader(directory, doc["tensors"], meta["files"])
    readers.append(reader)
    files = [rank_file(name, r, meta["world_size"]) for r in range(meta["world_size"])]
    metas = []
    for f in files:
        if f not in meta["files"]:
            raise CheckpointError(f"checkpoint file {os.path.join(directory, f)} is not listed in checkpoint.json "
                                  "(a rank's file)")
        try:
            metas.append(rank_meta(reader.file(f)))
        except (json.JSONDecodeError, RecursionError) as e:
            raise CheckpointError(f"checkpoint file {os.path.join(directory, f)}: its piece description is not "
                                  f"valid JSON: {e}") from None
    build = universal.model_index if fmt == universal.MODEL_INDEX else universal.optimizer_index
    try:
        rebuilt = json.loads(json.dumps(build(directory, files, metas)))
    except CheckpointError:
        raise
    except (KeyError, TypeError, ValueError, IndexError, AttributeError, RecursionError) as e:
        raise CheckpointError(f"checkpoint {directory}: the piece descriptions in the headers of {files} are "
                              f"malformed ({type(e).__name__}: {e})") from None
    if rebuilt != doc:
        raise CheckpointError(f"checkpoint file {path} does not match the piece files' own descriptions (edited, "
                              "or mixed from two checkpoints?)")
    reader.validate()
    return doc, reader


def _run_load_hooks(accelerator: Any, input_dir: str, meta: dict) -> list:
    """The load_model_state_pre_hooks, then the check that the checkpoint holds a model for each one here."""
    models = list(accelerator._models)
    for hook in accelerator._load_model_state_pre_hook.values():
        hook(models, input_dir)
    if len(models) > len(meta["models"]):
        raise CheckpointError(f"{input_dir} holds {len(meta['models'])} model(s), {len(models)} to load")
    return models


def _plan_small(accelerator: Any, plan: _Plan, input_dir: str, meta: dict) -> None:
    sizes, saved_world, world = meta["files"], meta["world_size"], int(accelerator.num_processes)
    _need(input_dir, "scheduler", accelerator._schedulers, meta["schedulers"])
    plan.schedulers = [(name, read_state(input_dir, name, "scheduler", sizes=sizes))
                       for _, name in zip(accelerator._schedulers, meta["schedulers"])]
    if getattr(accelerator, "scaler", None) is not None:
        if meta.get("scaler") is None:
            raise CheckpointError(f"{input_dir} has no GradScaler state but this run uses one")
        plan.scaler = (meta["scaler"], read_state(input_dir, meta["scaler"], "scaler", sizes=sizes))
    plan.rng = _read_rng(int(accelerator.process_index), input_dir, sizes, saved_world, world)
    plan.dataloaders = _read_dataloaders(accelerator, input_dir, sizes, saved_world, world)
    plan.fp8 = scaling.read_scaling(accelerator, input_dir, meta, sizes)
    custom = [f for f in os.listdir(input_dir) if _CUSTOM_RE.match(f)]
    if len(custom) != len(accelerator._custom_objects):
        raise RuntimeError(
            f"Number of custom checkpoints in folder {input_dir} does not match the number of registered objects:"
            f"\n\tFound checkpoints: {len(custom)}\n\tRegistered objects: {len(accelerator._custom_objects)}\n"
            "Please make sure to only load checkpoints from folders that were created with the same set of "
            "registered objects.")
    plan.custom = [(f"custom_checkpoint_{i}", read_state(input_dir, f"custom_checkpoint_{i}", "custom", sizes=sizes))
                   for i in range(len(accelerator._custom_objects))]


def _read_rng(rank: int, input_dir: str, sizes: dict, saved_world: int, world: int) -> Optional[dict]:
    """Rank r's saved RNG, tried on scratch generators; under another world size a rank without one keeps its
    current RNG (None, a warning)."""
    name = f"random_states_{rank}"
    if f"{name}.json" not in sizes and saved_world != world:
        logger.warning("Rank %d: %s has no RNG state for this rank (saved with %s processes); keeping the "
                       "current RNG state", rank, input_dir, saved_world)
        return None
    states = read_state(input_dir, name, "rng", sizes=sizes)
    try:
        random.Random().setstate(states["python"])
        np.random.RandomState().set_state(states["numpy"])
        torch.Generator().set_state(states["torch"])
    except Exception as e:   # scratch generators: whatever they refuse is not an RNG state

        raise CheckpointError(f"checkpoint file {os.path.join(input_dir, name)}.json holds no valid RNG state: "
                              f"{type(e).__name__}: {e}") from None
    return states


def _read_dataloaders(accelerator: Any, input_dir: str, sizes: dict, saved_world: int, world: int) -> Optional[list]:
    if not accelerator._dataloaders:
        return None
    name = f"dataloader_states_{accelerator.process_index}"
    if f"{name}.json" not in sizes and saved_world != world:
        name = "dataloader_states_0"
    states = read_state(input_dir, name, "dataloaders", sizes=sizes)
    if not isinstance(states, list) or len(states) < len(accelerator._dataloaders):
        raise CheckpointError(f"{input_dir} holds {len(states) if isinstance(states, list) else 'no list of'} "
                              f"dataloader state(s), {len(accelerator._dataloaders)} to load")
    return states


# ------------------------------------------------------------------------------------------ 3. small states
def _apply_small(accelerator: Any, plan: Optional[_Plan]) -> tuple[Callable[[], None], Optional[BaseException]]:
    """Applies the small states, each after a snapshot; returns (put every snapshot back, the error or None).
    On an error the snapshots taken so far are already back."""
    undo: list[Callable[[], None]] = []

    def restore() -> None:
        for fn in reversed(undo):
            fn()
        undo.clear()

    if plan is None:
        return restore, None
    try:
        for sched, st in zip(accelerator._schedulers, plan.schedulers):
            _swap(undo, sched, st, plan.input_dir)
        if plan.scaler is not None:
            _swap(undo, accelerator.scaler, plan.scaler, plan.input_dir)
        if plan.rng is not None:
            before = rng_state()
            undo.append(lambda: set_rng_state(before))
            set_rng_state(plan.rng)
        # loaders after the RNG: a loader borrows its epoch-start RNG snapshot only while it rebuilds its sampler
        if plan.dataloaders is not None:
            _apply_dataloaders(accelerator, plan.dataloaders, undo)
        scaling.apply_scaling(accelerator, plan.fp8, plan.input_dir, strict=plan.strict)
        for obj, st in zip(accelerator._custom_objects, plan.custom):
            _swap(undo, obj, st, plan.input_dir)
    except Exception as e:
        restore()
        return restore, e
    return restore, None


def _swap(undo: list, obj: Any, named_state: tuple[str, Any], input_dir: str) -> None:
    """obj.load_state_dict(state) after a snapshot; what it refuses is a CheckpointError naming the file."""
    name, state = named_state
    before = obj.state_dict()
    undo.append(lambda: obj.load_state_dict(before))
    try:
        obj.load_state_dict(state)
    except Exception as e:
        raise CheckpointError(f"checkpoint file {os.path.join(input_dir, name)}.json: its state does not load into "
                              f"{type(obj).__name__}: {type(e).__name__}: {e}") from e


def _apply_dataloaders(accelerator: Any, states: list, undo: list) -> None:
    """Stateful loaders resume at the saved batch; otherwise only the epoch counter and the epoch's shuffle state
    come back (the batch position is left alone, as in HF, so a script's own skip_first_batches replays exactly
    the saved epoch order without skipping twice). Under another world size a rank without a saved state gets
    rank 0's."""
    stateful = bool(getattr(accelerator, "use_stateful_dataloader", False))
    for dl, st in zip(accelerator._dataloaders, states):
        if st is None:
            continue
        before = _state_dict_or_none(dl)
        if stateful:
            load = dl.load_state_dict
        elif "resume_position" in inspect.signature(dl.load_state_dict).parameters:
            def load(s: Any, dl: Any = dl) -> None:
                dl.load_state_dict(s, resume_position=False)
        else:
            continue
        if before is not None:
            undo.append(lambda load=load, before=before: load(before))
        try:
            load(st)
        except Exception as e:
            raise CheckpointError(f"the saved dataloader state does not load into {type(dl).__name__}: "
                                  f"{type(e).__name__}: {e}") from e


# ---------------------------------------------------------------------------------------------- 4. tensors
def _apply_tensors(accelerator: Any, plan: _Plan, kwargs: dict, what: str) -> None:
    strategy = strategy_of(accelerator)
    error = None
    try:
        for _, target, index, reader, slices in plan.models:
            universal.load_model(reader, index, target, slices, **kwargs)
    except Exception as e:   # validated: only a read error (a file changed since phase 1) gets here
        error = e
    agree(accelerator, error, what, "reading the model tensors: they may be partly loaded")
    for model, *_ in plan.models:
        # collective: e.g. ZeRO-1/2 re-gather full parameters from the shards (a layout object without it: nothing)
        getattr(strategy, "slices_loaded", lambda m: None)(model)
    for load in plan.optimizers:
        load.apply()
    accelerator.step = int(plan.step)
