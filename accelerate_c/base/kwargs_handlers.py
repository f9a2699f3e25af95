# accelerate_c/base/kwargs_handlers.py: the KwargsHandler dataclasses users pass in
# Accelerator(kwargs_handlers=[...]), with HF Accelerate's names, fields and defaults.
# Not for: acting on them (strategies and precision objects read the fields they own).
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Optional

from .dataclasses import KwargsHandler


class DDPCommunicationHookType(str, enum.Enum):
    NO = "no"
    FP16 = "fp16"
    BF16 = "bf16"
    POWER_SGD = "power_sgd"
    BATCHED_POWER_SGD = "batched_power_sgd"


@dataclass
class AutocastKwargs(KwargsHandler):
    enabled: bool = True
    cache_enabled: Optional[bool] = None


@dataclass
class DistributedDataParallelKwargs(KwargsHandler):
    dim: int = 0
    broadcast_buffers: bool = True
    bucket_cap_mb: int = 25
    find_unused_parameters: bool = False
    check_reduction: bool = False
    gradient_as_bucket_view: bool = False
    static_graph: bool = False
    comm_hook: DDPCommunicationHookType = DDPCommunicationHookType.NO
    comm_wrapper: Any = DDPCommunicationHookType.NO
    comm_state_option: dict = field(default_factory=dict)


@dataclass
class GradScalerKwargs(KwargsHandler):
    init_scale: float = 65536.0
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    enabled: bool = True


@dataclass
class InitProcessGroupKwargs(KwargsHandler):
    backend: Optional[str] = "nccl"
    init_method: Optional[str] = None
    timeout: Optional[timedelta] = None

    def __post_init__(self) -> None:
        if self.timeout is None:
            self.timeout = timedelta(seconds=1800)


@dataclass
class FP8RecipeKwargs(KwargsHandler):
    """fp8 recipe: format E4M3 or HYBRID (e4m3 forward, e5m2 gradients), current or delayed scaling."""

    backend: Optional[str] = None
    fp8_format: Optional[str] = None  # "E4M3" | "HYBRID"; env ACCELERATE_FP8_FORMAT
    margin: Optional[int] = None
    interval: Optional[int] = None
    amax_history_len: Optional[int] = None
    amax_compute_algo: Optional[str] = None  # "max" | "most_recent"
    use_delayed_scaling: Optional[bool] = None
    module_filter_func: Optional[Callable] = None
    use_autocast_during_eval: Optional[bool] = None
    override_linear_precision: Optional[tuple] = None
    opt_level: Optional[str] = None


TERecipeKwargs = FP8RecipeKwargs


@dataclass
class ProfileKwargs(KwargsHandler):
    """torch.profiler options for `Accelerator.profile()`. activities: names among "cpu", "cuda", "xpu",
    "mtia", "hpu" (those this machine has); schedule_option: torch.profiler.schedule's keywords (wait, warmup,
    active, repeat, skip_first); output_trace_dir: where `profile()` writes the chrome traces on exit."""

    activities: Optional[list] = None
    schedule_option: Optional[dict] = None
    on_trace_ready: Optional[Callable] = None
    record_shapes: bool = False
    profile_memory: bool = False
    with_stack: bool = False
    with_flops: bool = False
    with_modules: bool = False
    output_trace_dir: Optional[str] = None

    def _get_profiler_activity(self, activity: str) -> Any:
        import torch  # not at import time: `import accelerate_c.utils` stays light

        known = {"cpu": torch.profiler.ProfilerActivity.CPU, "cuda": torch.profiler.ProfilerActivity.CUDA}
        # The other device kinds count only where this torch build has the activity and the device exists.
        for name in ("xpu", "mtia", "hpu"):
            kind = getattr(torch.profiler.ProfilerActivity, name.upper(), None)
            backend = getattr(torch, name, None)
            try:
                present = kind is not None and backend is not None and backend.is_available()
            except Exception:  # a backend stub that cannot answer
                present = False
            if present:
                known[name] = kind
        if activity not in known:
            raise ValueError(f"Invalid profiler activity: {activity}. Must be one of {list(known)}.")
        return known[activity]

    def build(self) -> Any:
        """The `torch.profiler.profile` these options describe (not yet entered)."""
        import torch

        activities = None if self.activities is None else [self._get_profiler_activity(a) for a in self.activities]
        schedule = None
        if self.schedule_option is not None:
            given = set(self.schedule_option)
            unknown = given - {"wait", "warmup", "active", "repeat", "skip_first", "skip_first_wait"}
            missing = {"wait", "warmup", "active"} - given
            if unknown or missing:
                raise ValueError(f"ProfileKwargs.schedule_option={self.schedule_option!r}: needs wait, warmup and "
                                 "active (optional: repeat, skip_first, skip_first_wait)"
                                 + (f"; unknown: {sorted(unknown)}" if unknown else "")
                                 + (f"; missing: {sorted(missing)}" if missing else ""))
            schedule = torch.profiler.schedule(**self.schedule_option)
        return torch.profiler.profile(activities=activities, schedule=schedule, on_trace_ready=self.on_trace_ready,
                                      record_shapes=self.record_shapes, profile_memory=self.profile_memory,
                                      with_stack=self.with_stack, with_flops=self.with_flops,
                                      with_modules=self.with_modules)
