# accelerate_c.pipeline: pipeline parallelism for training and evaluation. Schedules as per-rank action lists
# (schedules.py: GPipe, 1F1B, interleaved 1F1B, ZB-H1) checked and timed by one simulator (simulator.py, pictures in
# render.py); stages cut from a model (stages.py, adapters.py); the engine of one rank (engine.py: PipelineEngine)
# that runs its actions (runtime.py) over comm's point-to-point channels, with zero-bubble's B/W split (deferred.py).
# Not for: choosing the degrees or building the process groups (the layout object), the optimizer step.
from accelerate_c.pipeline.engine import PipelineEngine, PipelineOutput
from accelerate_c.pipeline.schedules import NAMES, Action, Schedule, build_schedule, forward_only
from accelerate_c.pipeline.simulator import ScheduleError, SimResult, simulate

__all__ = ["PipelineEngine", "PipelineOutput", "NAMES", "Action", "Schedule", "build_schedule", "forward_only",
           "ScheduleError", "SimResult", "simulate"]
