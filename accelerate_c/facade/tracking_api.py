# accelerate_c/facade/tracking_api.py: the observability half of the Accelerator API, as a mixin:
# experiment trackers (init_trackers, log, get_tracker; `end_training` in accelerator.py finishes them) and
# the torch profiler (`profile`). HF Accelerate 1.15 semantics: trackers are created, started and written on
# the main process only; every other rank holds none and its calls do nothing.
# Not for: tracker implementations or the choice of trackers (accelerate_c/tracking/).
from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Any, Iterator, Optional

# HF's chrome-trace file name; the suffix is the process index.
PROFILE_PATTERN_NAME = "profile_{suffix}.json"


class TrackingAPI:
    log_with: list
    trackers: list
    profile_handler: Any

    def init_trackers(self, project_name: str, config: Optional[dict] = None,
                      init_kwargs: Optional[dict] = None) -> None:
        """Builds and starts every tracker of `log_with` (main process only); `config` is stored as the run's
        hyperparameters; `init_kwargs` = {tracker name: {kwargs for its constructor}}."""
        if not self.is_main_process:
            return
        from ..tracking import LOGGER_TYPE_TO_CLASS, GeneralTracker

        init_kwargs = init_kwargs or {}
        for entry in self.log_with:
            if isinstance(entry, GeneralTracker):  # the user's instance: already built
                self.trackers.append(entry)
                continue
            name = str(entry)
            cls = LOGGER_TYPE_TO_CLASS[name]
            kwargs = init_kwargs.get(name, {})
            # The directory was checked when the Accelerator was built (filter_trackers).
            args = (project_name, self.logging_dir) if cls.requires_logging_directory else (project_name,)
            self.trackers.append(cls(*args, **kwargs))
        for tracker in self.trackers:
            tracker.start()
        if config is not None:
            for tracker in self.trackers:
                tracker.store_init_configuration(config)

    def get_tracker(self, name: str, unwrap: bool = False) -> Any:
        """The tracker whose `name` is `name` (its underlying run/writer when `unwrap`). On ranks without
        trackers, a blank GeneralTracker, so `get_tracker(...).log(...)` is a harmless no-op there."""
        from ..tracking import GeneralTracker

        if not self.trackers:
            return GeneralTracker(_blank=True)
        for tracker in self.trackers:
            if tracker.name == name:
                return tracker.tracker if unwrap else tracker
        names = [t.name for t in self.trackers]
        raise ValueError(f"{name} is not an available tracker stored inside the `Accelerator` (have: {names}).")

    def log(self, values: dict, step: Optional[int] = None, log_kwargs: Optional[dict] = None) -> None:
        """Logs `values` to every tracker (main process only); `log_kwargs` = {tracker name: {kwargs}}."""
        if not self.is_main_process:
            return
        log_kwargs = log_kwargs or {}
        for tracker in self.trackers:
            tracker.log(values, step=step, **log_kwargs.get(tracker.name, {}))

    @contextmanager
    def profile(self, profile_handler: Any = None) -> Iterator[Any]:
        """Runs the block under `torch.profiler` (configured by `profile_handler`, else the Accelerator's
        ProfileKwargs, else defaults) and yields the profiler. With `output_trace_dir` set, each process
        writes its chrome trace to `<output_trace_dir>/profile_<process_index>.json` on exit (HF's rule),
        then all processes meet at a barrier."""
        from ..base.kwargs_handlers import ProfileKwargs

        handler = profile_handler or self.profile_handler or ProfileKwargs()
        with handler.build() as profiler:
            yield profiler
        if handler.output_trace_dir is None:
            return
        os.makedirs(handler.output_trace_dir, exist_ok=True)
        profiler.export_chrome_trace(os.path.join(handler.output_trace_dir,
                                                  PROFILE_PATTERN_NAME.format(suffix=self.process_index)))
        self.wait_for_everyone()
