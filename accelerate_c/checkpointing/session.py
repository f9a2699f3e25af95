# accelerate_c/checkpointing/session.py: `Accelerator.save_state` / `load_state` under any strategy and world size
# (universal checkpoints: logical tensors, loadable by any other strategy/world size).
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
# Not for: the piece files (pieces.py), the meaning of the pieces (universal.py).
from __future__ import annotations

import inspect
import logging
import os
import random
import re
import shutil
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch

from . import atomic
from . import scaling
from . import universal
from .format import CheckpointError, check_format, read_json, read_state, write_json, write_state
from .pieces import PieceReader, rank_file, read_rank_meta, write_rank_file
from .layout import strategy_of
from .universal import user_model as _user_model

logger = logging.getLogger(__name__)

CHECKPOINT_FILE = "checkpoint.json"
CHECKPOINT_FORMAT = "accelerate_c.checkpoint"
CHECKPOINT_VERSION = 2   # 1: one model.safetensors/optimizer state file written by the main process
_AUTO_RE = re.compile(r"^checkpoint_(\d+)$")
_CUSTOM_RE = re.compile(r"^custom_checkpoint_(\d+)\.json$")


def _nth(base: str, i: int) -> str:
    return base if i == 0 else f"{base}_{i}"


def _is_coordinator(accelerator: Any) -> bool:
    if getattr(accelerator.project_configuration, "save_on_each_node", False):
        return bool(getattr(accelerator, "is_local_main_process", accelerator.is_main_process))
    return bool(accelerator.is_main_process)


def list_checkpoints(checkpoints_dir: str) -> list[tuple[int, str]]:
    """Complete `checkpoint_{N}` folders under checkpoints_dir, sorted by N (temp/partial ones skipped)."""
    if not os.path.isdir(checkpoints_dir):
        return []
    found = []
    for name in os.listdir(checkpoints_dir):
        m = _AUTO_RE.match(name)
        path = os.path.join(checkpoints_dir, name)
        if m and os.path.isfile(os.path.join(path, CHECKPOINT_FILE)):
            found.append((int(m.group(1)), path))
    return sorted(found)


def latest_checkpoint(checkpoints_dir: str) -> Optional[str]:
    found = list_checkpoints(checkpoints_dir)
    return found[-1][1] if found else None


def read_checkpoint_info(checkpoint_dir: str) -> dict:
    """The validated checkpoint.json of a checkpoint directory."""
    path = os.path.join(checkpoint_dir, CHECKPOINT_FILE)
    if not os.path.isfile(path):
        pickled = [f for f in ("optimizer.bin", "random_states_0.pkl", "pytorch_model.bin")
                   if os.path.isfile(os.path.join(checkpoint_dir, f))]
        hint = (f" It holds {pickled}: an HF Accelerate (pickle) checkpoint, which accelerate_c does not "
                "unpickle." if pickled else " (not a checkpoint, or its save did not finish)")
        raise CheckpointError(f"checkpoint file {path} is missing.{hint}")
    doc = read_json(path)
    if isinstance(doc, dict) and doc.get("format") == CHECKPOINT_FORMAT and doc.get("version") == 1:
        raise CheckpointError(f"checkpoint file {path} has format version 1 (written by an accelerate_c before "
                              f"universal checkpoints); this accelerate_c reads version {CHECKPOINT_VERSION}. Load it "
                              "with the accelerate_c that wrote it and save_state again to convert it.")
    return check_format(path, doc, CHECKPOINT_FORMAT, CHECKPOINT_VERSION, "checkpoint index")


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


@dataclass
class DataPosition:
    """Where a dataloader stood when the checkpoint was saved (None where its state_dict lacks the key)."""
    epoch: Optional[int]
    batches_consumed: Optional[int]
    samples_consumed: Optional[int]
    state: Any


def read_data_position(checkpoint_dir: str, dataloader_index: int = 0, process_index: int = 0) -> DataPosition:
    """Data position saved for one dataloader of one rank. Reads the keys "epoch" and "batches_consumed"
    (and "samples_consumed") of the dataloader's state_dict; `state` is the whole decoded state_dict."""
    read_checkpoint_info(checkpoint_dir)
    states = read_state(checkpoint_dir, f"dataloader_states_{process_index}", kind="dataloaders")
    if not 0 <= dataloader_index < len(states):
        raise IndexError(f"checkpoint {checkpoint_dir} holds {len(states)} dataloader states")
    st = states[dataloader_index]
    get = (lambda k: st.get(k)) if isinstance(st, dict) else (lambda k: None)
    return DataPosition(get("epoch"), get("batches_consumed"), get("samples_consumed"), st)


def _rng_state() -> dict:
    states: dict[str, Any] = {"python": random.getstate(), "numpy": np.random.get_state(),
                              "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def _set_rng_state(states: dict) -> None:
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])
    if "cuda" in states and torch.cuda.is_available():
        cuda = states["cuda"]
        n = torch.cuda.device_count()
        if len(cuda) != n:
            logger.warning("CUDA RNG saved for %d devices, %d visible: restoring the first %d",
                           len(cuda), n, min(n, len(cuda)))
        for i in range(min(n, len(cuda))):
            torch.cuda.set_rng_state(cuda[i], i)


def _state_dict_or_none(obj: Any) -> Any:
    fn = getattr(obj, "state_dict", None)
    return fn() if callable(fn) else None


def save_state(accelerator: Any, output_dir: Optional[str] = None, safe_serialization: bool = True,
               **save_model_func_kwargs: Any) -> str:
    """Saves models, optimizers, schedulers, scaler, custom objects, every rank's RNG and data position and
    the step to output_dir (or `{project_dir}/checkpoints/checkpoint_{iteration}`); returns the path.
    Must be called on every process. `safe_serialization=False` is accepted but weights stay safetensors."""
    pc = accelerator.project_configuration
    coord = _is_coordinator(accelerator)
    auto_root = None
    if pc.automatic_checkpoint_naming:
        if pc.project_dir is None:
            raise ValueError("automatic_checkpoint_naming needs ProjectConfiguration(project_dir=...)")
        auto_root = os.path.join(os.path.abspath(os.path.expanduser(pc.project_dir)), "checkpoints")
        output_dir = os.path.join(auto_root, f"checkpoint_{pc.iteration}")
        if os.path.exists(output_dir):
            raise ValueError(f"Checkpoint directory {output_dir} ({pc.iteration}) already exists. Please manually "
                             "override `project_configuration.iteration` with what iteration to start with.")
    elif output_dir is None:
        raise ValueError("save_state needs output_dir unless ProjectConfiguration(automatic_checkpoint_naming=True)")
    output_dir = os.path.abspath(os.path.expanduser(os.fspath(output_dir)))
    if not safe_serialization:
        logger.info("accelerate_c checkpoints never pickle: model weights are written as safetensors anyway")
    tmp = atomic.temp_dir_for(output_dir)
    if coord:
        if auto_root is not None:
            os.makedirs(auto_root, exist_ok=True)
            for name in os.listdir(auto_root):     # leftovers of interrupted saves
                if atomic.is_internal_name(name):
                    shutil.rmtree(os.path.join(auto_root, name), ignore_errors=True)
        atomic.prepare_temp_dir(output_dir, CHECKPOINT_FILE)
    accelerator.wait_for_everyone()

    # Every rank writes the model/optimizer pieces it owns (no gather), its RNG and its data position.
    strategy = strategy_of(accelerator)
    if accelerator._save_model_state_pre_hook:
        # (HF: no weights where its FSDP / DeepSpeed engine saves the models; get_state_dict is then rank 0's alone)
        weights = ([] if strategy.hooks_get_no_weights()
                   else [accelerator.get_state_dict(m) for m in accelerator._models])
        for hook in accelerator._save_model_state_pre_hook.values():
            hook(list(accelerator._models), weights, tmp)
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
    sched_states = [s.state_dict() for s in accelerator._schedulers]
    custom_states = [obj.state_dict() for obj in accelerator._custom_objects]
    scaler = getattr(accelerator, "scaler", None)
    rng = _rng_state()
    rng["step"] = int(accelerator.step)
    dl_states = [_state_dict_or_none(dl) for dl in accelerator._dataloaders]
    write_state(tmp, f"random_states_{rank}", rng, kind="rng")
    write_state(tmp, f"dataloader_states_{rank}", dl_states, kind="dataloaders")
    has_fp8 = scaling.save_scaling(accelerator, tmp, rank)
    meta: dict[str, Any] = {}
    if coord:
        for i, st in enumerate(sched_states):
            write_state(tmp, _nth("scheduler", i), st, kind="scheduler")
        for i, st in enumerate(custom_states):
            write_state(tmp, f"custom_checkpoint_{i}", st, kind="custom")
        if scaler is not None:
            write_state(tmp, "scaler", scaler.state_dict(), kind="scaler")
        meta = {
            "models": model_names,
            "optimizers": opt_names,
            "schedulers": [_nth("scheduler", i) for i in range(len(sched_states))],
            "custom_objects": [f"custom_checkpoint_{i}" for i in range(len(custom_states))],
            "scaler": "scaler" if scaler is not None else None,
            scaling.META_KEY: has_fp8,
            "num_dataloaders": len(dl_states),
            "data_position": [{k: st.get(k) for k in ("epoch", "batches_consumed", "samples_consumed")}
                              if isinstance(st, dict) else None for st in dl_states],
        }
    accelerator.wait_for_everyone()
    # Every rank builds the indexes from the headers (small reads), so a bad layout raises on every rank.
    indexes = {}
    for names, build in ((model_names, universal.model_index), (opt_names, universal.optimizer_index)):
        for name in names:
            files = [rank_file(name, r, world) for r in range(world)]
            indexes[name] = build(tmp, files, [read_rank_meta(os.path.join(tmp, f)) for f in files])
    accelerator.wait_for_everyone()
    if coord:
        for name, doc in indexes.items():
            write_json(os.path.join(tmp, f"{name}.json"), doc)
        old_files: list[str] = []
        if os.path.isfile(os.path.join(output_dir, CHECKPOINT_FILE)):
            try:
                old_files = list(read_json(os.path.join(output_dir, CHECKPOINT_FILE)).get("files", {}))
            except (CheckpointError, AttributeError):
                old_files = []
        files = {n: os.path.getsize(os.path.join(tmp, n)) for n in sorted(os.listdir(tmp))
                 if os.path.isfile(os.path.join(tmp, n))}
        meta = {"format": CHECKPOINT_FORMAT, "version": CHECKPOINT_VERSION,
                "world_size": int(accelerator.num_processes), "step": int(accelerator.step),
                "iteration": int(pc.iteration), "torch_version": torch.__version__, **meta, "files": files}
        write_json(os.path.join(tmp, CHECKPOINT_FILE), meta)
        atomic.commit(tmp, output_dir, CHECKPOINT_FILE, drop_from_old=old_files + [CHECKPOINT_FILE])
        if auto_root is not None and pc.total_limit is not None:
            found = list_checkpoints(auto_root)
            for _, path in found[: max(0, len(found) - pc.total_limit)]:
                logger.warning("Deleting checkpoint %s (total_limit=%d)", path, pc.total_limit)
                shutil.rmtree(path)
    accelerator.wait_for_everyone()
    pc.iteration += 1
    return output_dir


def _resolve_input_dir(accelerator: Any, input_dir: Optional[str]) -> str:
    pc = accelerator.project_configuration
    if input_dir is not None:
        want = os.path.abspath(os.path.expanduser(os.fspath(input_dir)))
        found = atomic.resolve_for_read(want, CHECKPOINT_FILE)
        if found is None:
            raise ValueError(f"Tried to find {input_dir} but folder does not exist")
        return found
    if pc.automatic_checkpoint_naming and pc.project_dir is not None:
        root = os.path.join(os.path.abspath(os.path.expanduser(pc.project_dir)), "checkpoints")
        found = latest_checkpoint(root)
        if found is None:
            raise ValueError(f"No complete checkpoint_N folder found in {root}")
        # Beyond HF: the next automatic save goes after the checkpoint we resumed from, instead of
        # failing on "checkpoint_0 already exists" until the user sets project_configuration.iteration.
        pc.iteration = max(pc.iteration, int(os.path.basename(found).rsplit("_", 1)[-1]) + 1)
        return found
    raise ValueError("No input_dir provided and automatic checkpoint naming is disabled.")


def _read_index(directory: str, name: str, fmt: str) -> dict:
    path = os.path.join(directory, f"{name}.json")
    return check_format(path, read_json(path), fmt, universal.INDEX_VERSION, "tensor index")


def load_state(accelerator: Any, input_dir: Optional[str] = None, load_kwargs: Optional[dict] = None,
               **load_model_func_kwargs: Any) -> str:
    """Restores what save_state wrote (this rank's RNG only); returns the directory read.
    map_location (None/"cpu"/"on_device") picks where optimizer tensors are materialised; other keyword
    arguments go to `load_state_dict` of the models (e.g. strict=False). load_kwargs is accepted for HF
    compatibility and unused (there is no torch.load)."""
    input_dir = _resolve_input_dir(accelerator, input_dir)
    meta = read_checkpoint_info(input_dir)
    sizes = meta.get("files", {})
    map_location = load_model_func_kwargs.pop("map_location", None)
    if map_location not in (None, "cpu", "on_device"):
        raise TypeError("Unsupported optimizer map location passed, please choose one of `None`, `'cpu'`, "
                        "or `'on_device'`")
    device = str(getattr(accelerator, "device", "cpu")) if map_location == "on_device" else "cpu"
    rank, world, saved_world = accelerator.process_index, accelerator.num_processes, meta.get("world_size")
    if saved_world != world and accelerator.is_main_process:
        logger.warning(
            "Checkpoint %s was saved by %s processes and is loaded by %s. Model, optimizer, scheduler, scaler "
            "and custom objects are restored in full. RNG: rank r reads random_states_r; ranks >= %s have no "
            "saved RNG and keep their current state; fp8 amax histories: rank r reads saved rank r %% %s. "
            "Data position: rank r's dataloader state (rank 0's for "
            "ranks without one) is handed to the dataloader, which must re-map it to the new world size.",
            input_dir, saved_world, world, saved_world, saved_world)

    models = list(accelerator._models)
    for hook in accelerator._load_model_state_pre_hook.values():
        hook(models, input_dir)
    if len(models) > len(meta["models"]):
        raise CheckpointError(f"{input_dir} holds {len(meta['models'])} model(s), {len(models)} to load")
    strategy = strategy_of(accelerator)
    for i, model in enumerate(models):
        name = meta["models"][i]
        index = _read_index(input_dir, name, universal.MODEL_INDEX)
        # keep_torch_compile=False: the user's module itself (the compiled wrapper's keys carry a prefix, and
        # unwrapping with keep_torch_compile=True re-points the wrapper's _orig_mod, as HF does)
        target = accelerator.unwrap_model(model, keep_torch_compile=False)
        with PieceReader(input_dir, index["tensors"], sizes) as reader:
            universal.load_model(reader, index, target, strategy.model_slices(_user_model(model)),
                                 **load_model_func_kwargs)
        # collective: e.g. ZeRO-1/2 re-gather full parameters from the shards (a layout object without it: nothing)
        getattr(strategy, "slices_loaded", lambda m: None)(model)

    def need(kind: str, objs: list, names: list) -> None:
        if len(objs) > len(names):
            raise CheckpointError(f"{input_dir} holds {len(names)} {kind} state(s), {len(objs)} to load")

    need("optimizer", accelerator._optimizers, meta["optimizers"])
    for opt, name in zip(accelerator._optimizers, meta["optimizers"]):
        index = _read_index(input_dir, name, universal.OPTIMIZER_INDEX)
        slots = strategy.optimizer_layout(opt, _model_of(accelerator, opt))
        with PieceReader(input_dir, index["tensors"], sizes) as reader:
            universal.load_optimizer(reader, index, opt, slots, device=device if device != "cpu" else None)
    need("scheduler", accelerator._schedulers, meta["schedulers"])
    for sched, name in zip(accelerator._schedulers, meta["schedulers"]):
        sched.load_state_dict(read_state(input_dir, name, kind="scheduler"))
    scaler = getattr(accelerator, "scaler", None)
    if scaler is not None:
        if meta.get("scaler") is None:
            raise CheckpointError(f"{input_dir} has no GradScaler state but this run uses one")
        scaler.load_state_dict(read_state(input_dir, meta["scaler"], kind="scaler"))

    rng_name = f"random_states_{rank}"
    if os.path.isfile(os.path.join(input_dir, rng_name + ".json")) or saved_world == world:
        _set_rng_state(read_state(input_dir, rng_name, kind="rng"))
    else:
        logger.warning("Rank %d: %s has no RNG state for this rank (saved with %s processes); keeping the "
                       "current RNG state", rank, input_dir, saved_world)
    # Loaders after the RNG: a loader borrows its epoch-start RNG snapshot only while it rebuilds its
    # sampler. Stateful loaders resume at the saved batch; otherwise only the epoch counter and the
    # epoch's shuffle state come back (the batch position is left alone, as in HF, so a script's own
    # skip_first_batches replays exactly the saved epoch order without skipping twice).
    if accelerator._dataloaders:
        stateful = bool(getattr(accelerator, "use_stateful_dataloader", False))
        dl_file = f"dataloader_states_{rank}"
        if not os.path.isfile(os.path.join(input_dir, dl_file + ".json")) and saved_world != world:
            dl_file = "dataloader_states_0"
        dl_states = read_state(input_dir, dl_file, kind="dataloaders")
        if len(dl_states) < len(accelerator._dataloaders):
            raise CheckpointError(f"{input_dir} holds {len(dl_states)} dataloader state(s), "
                                  f"{len(accelerator._dataloaders)} to load")
        for dl, st in zip(accelerator._dataloaders, dl_states):
            if st is None:
                continue
            if stateful:
                dl.load_state_dict(st)
            elif "resume_position" in inspect.signature(dl.load_state_dict).parameters:
                dl.load_state_dict(st, resume_position=False)
    scaling.load_scaling(accelerator, input_dir, meta, strict=load_model_func_kwargs.get("strict", True))
    accelerator.step = int(meta["step"])

    custom = [f for f in os.listdir(input_dir) if _CUSTOM_RE.match(f)]
    if len(custom) != len(accelerator._custom_objects):
        raise RuntimeError(
            f"Number of custom checkpoints in folder {input_dir} does not match the number of registered objects:"
            f"\n\tFound checkpoints: {len(custom)}\n\tRegistered objects: {len(accelerator._custom_objects)}\n"
            "Please make sure to only load checkpoints from folders that were created with the same set of "
            "registered objects.")
    for i, obj in enumerate(accelerator._custom_objects):
        obj.load_state_dict(read_state(input_dir, f"custom_checkpoint_{i}", kind="custom"))
    return input_dir
