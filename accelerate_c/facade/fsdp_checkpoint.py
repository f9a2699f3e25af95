# accelerate_c/facade/fsdp_checkpoint.py: HF's `accelerate.utils.fsdp_utils` functions (HF's path
# accelerate_c.utils.fsdp_utils is this module, a face) that transformers' Trainer calls when FSDP is on
# (save_fsdp_model / load_fsdp_model / save_fsdp_optimizer / load_fsdp_optimizer, HF 1.15 signatures) and
# get_parameters_from_modules (TRL). They go through the Accelerator's own calls, so they work for whatever strategy
# prepared the model (our sharded engine for FSDP). They write where HF's sharded layout puts its folders, so that
# transformers' checks for an FSDP checkpoint find them (it looks for a folder named after `pytorch_model_fsdp` /
# `optimizer`): `pytorch_model_fsdp_<index>/model.safetensors` (the whole state dict, never pickle) and
# `optimizer_<index>/rank<r>-of-<world>.json` + `.safetensors` (our state files: each process's optimizer state is its
# shard's, so each process writes and reads its own; resuming needs the same number of processes). HF's own
# torch.distributed.checkpoint contents of those folders are neither written nor read.
# Not for: the sharded engine itself (sharding/).
from __future__ import annotations

import os
import re
from typing import Any, Iterable, Union

import torch

from ..checkpointing.format import read_state, write_state
from ..checkpointing.stfile import TensorFile
from ..runtime.models import is_peft_model

FSDP_MODEL_NAME = "pytorch_model_fsdp"
FSDP_MODEL_FILE = "model.safetensors"  # the one file of a pytorch_model_fsdp_<index> folder


def _folder(base: str, index: int) -> str:
    return f"{base}_{index}"


def save_fsdp_model(fsdp_plugin: Any, accelerator: Any, model: torch.nn.Module, output_dir: str, model_index: int = 0,
                    adapter_only: bool = False, use_dcp: bool = True) -> None:
    """The model's whole state dict (gathered from the shards) into `output_dir`, written by the main process; with
    `adapter_only` (transformers always passes it) a PEFT model's adapter only, as HF (other models: everything).
    `use_dcp` (HF's choice of torch.distributed.checkpoint for sharded state dicts) is accepted and not used."""
    from safetensors.torch import save_file

    os.makedirs(output_dir, exist_ok=True)
    state = accelerator.get_state_dict(model)
    inner = accelerator.unwrap_model(model)
    if adapter_only and is_peft_model(inner) and state:  # HF: adapter_only matters for PEFT models only
        from peft import get_peft_model_state_dict

        state = get_peft_model_state_dict(inner, state_dict=state, adapter_name=inner.active_adapter)
    if accelerator.is_main_process:
        tensors = {k: v.detach().to("cpu").contiguous().clone() for k, v in state.items()}
        folder = os.path.join(output_dir, _folder(FSDP_MODEL_NAME, model_index))
        os.makedirs(folder, exist_ok=True)
        save_file(tensors, os.path.join(folder, FSDP_MODEL_FILE))
    accelerator.wait_for_everyone()


def load_fsdp_model(fsdp_plugin: Any, accelerator: Any, model: torch.nn.Module, input_dir: str, model_index: int = 0,
                    adapter_only: bool = False, use_dcp: bool = True) -> Any:
    """The state dict save_fsdp_model wrote, loaded into the prepared model on every process."""
    path = os.path.join(input_dir, _folder(FSDP_MODEL_NAME, model_index), FSDP_MODEL_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"load_fsdp_model: {path} not found (written by save_fsdp_model)")
    with TensorFile(path) as fh:
        state = fh.tensors()
    inner = accelerator.unwrap_model(model)
    if adapter_only and is_peft_model(inner):
        from peft import set_peft_model_state_dict

        return set_peft_model_state_dict(inner, state, adapter_name=inner.active_adapter)
    return inner.load_state_dict(state)


def _rank_name(accelerator: Any) -> str:
    return f"rank{accelerator.process_index}-of-{accelerator.num_processes}"


def save_fsdp_optimizer(fsdp_plugin: Any, accelerator: Any, optimizer: Any, model: torch.nn.Module, output_dir: str,
                        optimizer_index: int = 0, use_dcp: bool = True) -> None:
    """Every process's optimizer state (its shard's) as `optimizer_<index>/rank<r>-of-<world>.json` +
    `.safetensors`."""
    folder = os.path.join(output_dir, _folder("optimizer", optimizer_index))
    os.makedirs(folder, exist_ok=True)
    write_state(folder, _rank_name(accelerator), optimizer.state_dict(), "optimizer")
    accelerator.wait_for_everyone()


def load_fsdp_optimizer(fsdp_plugin: Any, accelerator: Any, optimizer: Any, model: torch.nn.Module, input_dir: str,
                        optimizer_index: int = 0, adapter_only: bool = False, use_dcp: bool = True) -> None:
    """This process's optimizer state from save_fsdp_optimizer's folder; a FileNotFoundError names the file when
    the checkpoint was written by another number of processes."""
    folder = os.path.join(input_dir, _folder("optimizer", optimizer_index))
    name = _rank_name(accelerator)
    if not os.path.isfile(os.path.join(folder, name + ".json")):
        found = sorted(f for f in os.listdir(folder) if f.endswith(".json")) if os.path.isdir(folder) else []
        raise FileNotFoundError(f"load_fsdp_optimizer: {os.path.join(folder, name + '.json')} not found (found "
                                f"{found}); the optimizer state is per process: resume with the same number of "
                                "processes")
    optimizer.load_state_dict(read_state(folder, name, "optimizer"))


def get_parameters_from_modules(modules: Union[Iterable[torch.nn.Module], str, None], model: torch.nn.Module,
                                device: Any) -> set:
    """The parameters of `modules` (a regex over module names is matched in full, those modules moved to
    `device`, as HF)."""
    if modules is None:
        return set()
    if isinstance(modules, str):
        pattern = re.compile(modules)
        found = []
        for name, module in model.named_modules():
            if pattern.fullmatch(name):
                module.to(device)
                found.append(module)
        modules = found
    return {p for m in modules for p in m.parameters()}
