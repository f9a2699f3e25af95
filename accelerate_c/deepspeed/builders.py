# accelerate_c/deepspeed/builders.py: the real optimizer and LR scheduler a DeepSpeed JSON "optimizer" /
# "scheduler" block describes (what DeepSpeed builds behind DummyOptim / DummyScheduler): Adam/AdamW/SGD on
# accelerate_c.optim's fused kernels, and DeepSpeed's WarmupLR / WarmupDecayLR / WarmupCosineLR schedules (same
# formulas, same step numbering) as torch LRSchedulers. Any other type or parameter is an error naming it.
# Not for: the blocks' accepted types and parameters, or the rest of the JSON (schema.py); "auto" values
# (prepare.py).
from __future__ import annotations

import math
from typing import Any

import torch

from .schema import OPTIMIZERS, SCHEDULERS, DeepSpeedConfigError, optimizer_kind


def _params(block: dict, kind: str, accepted: dict) -> dict:
    given = dict(block.get("params") or {})
    unknown = sorted(set(given) - set(accepted))
    if unknown:
        raise DeepSpeedConfigError(f"DeepSpeed config `{kind}.params.{unknown[0]}` is not supported by accelerate_c "
                                   f"for {kind} type {block['type']!r}; supported: {', '.join(accepted)}")
    missing = [k for k, v in accepted.items() if v is None and k not in given and not (k == "warmup_max_lr")]
    if missing:
        raise DeepSpeedConfigError(f"DeepSpeed config `{kind}.params.{missing[0]}` is required for {kind} type "
                                   f"{block['type']!r}")
    return {**accepted, **given}


def build_optimizer(block: dict, params: Any) -> torch.optim.Optimizer:
    """The optimizer of the JSON "optimizer" block over `params` (DummyOptim.params)."""
    from ..optim import SGD, Adam, AdamW
    kind = optimizer_kind(block)
    if kind == "SGD":
        p = _params(block, "optimizer", OPTIMIZERS["sgd"])
        return SGD(params, **p)
    p = _params(block, "optimizer", OPTIMIZERS[kind])
    if p.pop("bias_correction") is not True:
        raise DeepSpeedConfigError("DeepSpeed config `optimizer.params.bias_correction`: only true is supported")
    decoupled = p.pop("adam_w_mode") or kind == "adamw"  # DeepSpeed: "Adam" is AdamW unless adam_w_mode is false
    p.pop("torch_adam")  # torch's or the fused kernels: the same update here
    p["betas"] = tuple(p["betas"])
    return (AdamW if decoupled else Adam)(params, **p)


def is_ds_scheduler(obj: Any) -> bool:
    return isinstance(obj, _DeepSpeedSchedule)


def build_scheduler(block: dict, optimizer: torch.optim.Optimizer, calls_per_step: int = 1) -> Any:
    """The scheduler of the JSON "scheduler" block. `calls_per_step`: how many times the Accelerator's scheduler
    wrapper calls step() per optimizer step (num_processes unless split_batches): DeepSpeed steps its schedule
    once per optimizer step, so the schedule advances once per `calls_per_step` calls."""
    name = str(block["type"])
    if name not in SCHEDULERS:
        raise DeepSpeedConfigError(f"DeepSpeed config `scheduler.type`: {name!r} is not supported by accelerate_c; "
                                   f"supported: {', '.join(SCHEDULERS)}")
    p = _params(block, "scheduler", SCHEDULERS[name])
    if p.pop("last_batch_iteration") != -1:
        raise DeepSpeedConfigError("DeepSpeed config `scheduler.params.last_batch_iteration`: only -1 is supported "
                                   "(resume through load_state)")
    n = p["warmup_num_steps"]
    if not isinstance(n, int) or isinstance(n, bool) or n <= 0:
        raise DeepSpeedConfigError(f"DeepSpeed config `scheduler.params.warmup_num_steps`: got {n!r}; allowed: a "
                                   "positive integer")
    if p["warmup_type"] not in ("log", "linear"):
        raise DeepSpeedConfigError(f"DeepSpeed config `scheduler.params.warmup_type`: got {p['warmup_type']!r}; "
                                   "allowed: log, linear")
    cls = {"WarmupLR": WarmupLR, "WarmupDecayLR": WarmupDecayLR, "WarmupCosineLR": WarmupCosineLR}[name]
    return cls(optimizer, calls_per_step=calls_per_step, **p)


def _per_group(optimizer: torch.optim.Optimizer, value: Any, name: str) -> list:
    if isinstance(value, (list, tuple)):
        if len(value) != len(optimizer.param_groups):
            raise DeepSpeedConfigError(f"DeepSpeed config `scheduler.params.{name}`: expected "
                                       f"{len(optimizer.param_groups)} values (one per param group), got {value!r}")
        return list(value)
    return [value] * len(optimizer.param_groups)


class _DeepSpeedSchedule(torch.optim.lr_scheduler.LRScheduler):
    """DeepSpeed numbers its iterations from -1 (construction) and sets the lr of iteration k after its (k+1)-th
    step(); torch's LRScheduler steps once at construction, hence `iteration = last_epoch // calls - 1`."""

    def __init__(self, optimizer: torch.optim.Optimizer, warmup_num_steps: int, warmup_type: str,
                 calls_per_step: int) -> None:
        self.calls_per_step = max(1, int(calls_per_step))
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.warmup_type = warmup_type
        self.inverse_log_warm_up = 1.0 / math.log(self.warmup_num_steps)
        super().__init__(optimizer)

    @property
    def last_batch_iteration(self) -> int:
        return self.last_epoch // self.calls_per_step - 1

    def _warmup_gamma(self, it: int) -> float:
        if self.warmup_type == "log":
            return self.inverse_log_warm_up * math.log(it + 1)
        return it / self.warmup_num_steps


class WarmupLR(_DeepSpeedSchedule):
    """DeepSpeed's WarmupLR: min_lr -> max_lr over warmup_num_steps (log or linear), then max_lr."""

    def __init__(self, optimizer: torch.optim.Optimizer, warmup_min_lr: Any = 0.0, warmup_max_lr: Any = None,
                 warmup_num_steps: int = 1000, warmup_type: str = "log", calls_per_step: int = 1) -> None:
        if warmup_max_lr is None:
            warmup_max_lr = optimizer.param_groups[0]["lr"]
        self.min_lrs = _per_group(optimizer, warmup_min_lr, "warmup_min_lr")
        self.max_lrs = _per_group(optimizer, warmup_max_lr, "warmup_max_lr")
        super().__init__(optimizer, warmup_num_steps, warmup_type, calls_per_step)

    def _gamma(self, it: int) -> float:
        return self._warmup_gamma(it) if it < self.warmup_num_steps else 1.0

    def get_lr(self) -> list[float]:
        it = self.last_batch_iteration
        if it < 0:
            return list(self.min_lrs)
        g = self._gamma(it)
        return [lo + (hi - lo) * g for lo, hi in zip(self.min_lrs, self.max_lrs)]


class WarmupDecayLR(WarmupLR):
    """DeepSpeed's WarmupDecayLR: WarmupLR, then a linear decay to 0 at total_num_steps."""

    def __init__(self, optimizer: torch.optim.Optimizer, total_num_steps: int, warmup_min_lr: Any = 0.0,
                 warmup_max_lr: Any = 0.001, warmup_num_steps: int = 1000, warmup_type: str = "log",
                 calls_per_step: int = 1) -> None:
        self.total_num_steps = total_num_steps
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type, calls_per_step)

    def _gamma(self, it: int) -> float:
        if it < self.warmup_num_steps:
            return self._warmup_gamma(it)
        decay_steps = float(max(1.0, self.total_num_steps - self.warmup_num_steps))
        return max(0.0, float(self.total_num_steps - it) / decay_steps)


class WarmupCosineLR(_DeepSpeedSchedule):
    """DeepSpeed's WarmupCosineLR: ratio warmup_min_ratio -> 1 over the warmup, then a cosine to cos_min_ratio at
    total_num_steps (held there), times each group's initial lr."""

    def __init__(self, optimizer: torch.optim.Optimizer, total_num_steps: int, warmup_min_ratio: float = 0.0,
                 warmup_num_steps: int = 1000, cos_min_ratio: float = 0.0001, warmup_type: str = "log",
                 calls_per_step: int = 1) -> None:
        self.total_num_steps = total_num_steps
        self.warmup_min_ratio = warmup_min_ratio
        self.cos_min_ratio = cos_min_ratio
        self.org_lrs = [g["lr"] for g in optimizer.param_groups]
        super().__init__(optimizer, warmup_num_steps, warmup_type, calls_per_step)

    def _ratio(self, it: int) -> float:
        if it < 0:
            return 0.0
        if it < self.warmup_num_steps:
            return self.warmup_min_ratio + self._warmup_gamma(it) * (1.0 - self.warmup_min_ratio)
        progress = min(1.0, (it - self.warmup_num_steps + 1) / max(1, self.total_num_steps - self.warmup_num_steps))
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * (1 + math.cos(math.pi * progress)) / 2)

    def get_lr(self) -> list[float]:
        r = self._ratio(self.last_batch_iteration)
        return [lr * r for lr in self.org_lrs]
