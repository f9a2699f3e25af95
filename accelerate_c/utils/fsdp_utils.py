# accelerate_c/utils/fsdp_utils.py: HF's `accelerate.utils.fsdp_utils` functions that transformers' Trainer calls when
# FSDP is on (save_fsdp_model / load_fsdp_model / save_fsdp_optimizer / load_fsdp_optimizer, HF 1.15 signatures) and
# get_parameters_from_modules (TRL). They go through the Accelerator's own calls, so they work for whatever strategy
# prepared the model (our sharded engine for FSDP): the model as the whole state dict in safetensors
# (`pytorch_model_fsdp[_<index>].safetensors`, never pickle), the optimizer as our JSON + safetensors state files.
# HF's SHARDED_STATE_DICT folders (torch.distributed.checkpoint) are neither written nor read.
# Not for: the sharded engine itself (sharding/).
from __future__ import annotations

import os
import re
from typing import Any, Iterable, Union

import torch

from ..checkpointing.format import read_state, write_state
from ..checkpointing.stfile import TensorFile

FSDP_MODEL_NAME = "pytorch_model_fsdp"


def _name(base: str, index: int, suffix: str = "") -> str:
    return f"{base}{'' if index == 0 else f'_{index}'}{suffix}"


def save_fsdp_model(fsdp_plugin: Any, accelerator: Any, model: torch.nn.Module, output_dir: str, model_index: int = 0,
                    adapter_only: bool = False, use_dcp: bool = True) -> None:
    """The model's whole state dict (gathered from the shards) into `output_dir`, written by the main process
    (`use_dcp`, HF's choice of torch.distributed.checkpoint for sharded state dicts, is accepted and not used)."""
    from safetensors.torch import save_file

    os.makedirs(output_dir, exist_ok=True)
    state = accelerator.get_state_dict(model)
    if adapter_only:
        state = {k: v for k, v in state.items() if "lora_" in k or "modules_to_save" in k}
    if accelerator.is_main_process:
        tensors = {k: v.detach().to("cpu").contiguous().clone() for k, v in state.items()}
        save_file(tensors, os.path.join(output_dir, _name(FSDP_MODEL_NAME, model_index, ".safetensors")))
    accelerator.wait_for_everyone()


def load_fsdp_model(fsdp_plugin: Any, accelerator: Any, model: torch.nn.Module, input_dir: str, model_index: int = 0,
                    adapter_only: bool = False, use_dcp: bool = True) -> Any:
    """The state dict save_fsdp_model wrote, loaded into the prepared model on every process."""
    path = os.path.join(input_dir, _name(FSDP_MODEL_NAME, model_index, ".safetensors"))
    if not os.path.isfile(path):
        raise FileNotFoundError(f"load_fsdp_model: {path} not found (written by save_fsdp_model)")
    with TensorFile(path) as fh:
        state = fh.tensors()
    return accelerator.unwrap_model(model).load_state_dict(state, strict=not adapter_only)


def save_fsdp_optimizer(fsdp_plugin: Any, accelerator: Any, optimizer: Any, model: torch.nn.Module, output_dir: str,
                        optimizer_index: int = 0, use_dcp: bool = True) -> None:
    """The optimizer's state dict as `optimizer[_<index>].json` + `.safetensors`, written by the main process."""
    state = optimizer.state_dict()
    if accelerator.is_main_process:
        os.makedirs(output_dir, exist_ok=True)
        write_state(output_dir, _name("optimizer", optimizer_index), state, "optimizer")
    accelerator.wait_for_everyone()


def load_fsdp_optimizer(fsdp_plugin: Any, accelerator: Any, optimizer: Any, model: torch.nn.Module, input_dir: str,
                        optimizer_index: int = 0, adapter_only: bool = False, use_dcp: bool = True) -> None:
    optimizer.load_state_dict(read_state(input_dir, _name("optimizer", optimizer_index), "optimizer"))


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
