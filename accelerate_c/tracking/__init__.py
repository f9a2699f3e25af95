# accelerate_c/tracking: experiment trackers (`Accelerator(log_with=...)`) with HF Accelerate 1.15's names:
# GeneralTracker for custom trackers, the built-in trackers, the name → class registry
# (`register_tracker_class` adds to it) and `filter_trackers`, which turns `log_with` into the tracker list.
# Unlike HF, a tracker asked for by name whose package is missing is an error here, not silently dropped.
# Not for: calling trackers during training (accelerate_c/tracking_api.py, the Accelerator's mixin).
from __future__ import annotations

import os
import warnings
from typing import Any, Optional, Union

from ..base import imports as _imports
from ..base.dataclasses import LoggerType
from .base import GeneralTracker, on_main_process, plain_values
from .hosted import AimTracker, CometMLTracker, SwanLabTracker, TrackioTracker, WandBTracker
from .local import JSONLTracker, TensorBoardTracker, read_jsonl
from .mlops import ClearMLTracker, DVCLiveTracker, MLflowTracker

LOGGER_TYPE_TO_CLASS: dict[str, type[GeneralTracker]] = {
    "aim": AimTracker, "comet_ml": CometMLTracker, "mlflow": MLflowTracker, "tensorboard": TensorBoardTracker,
    "wandb": WandBTracker, "clearml": ClearMLTracker, "dvclive": DVCLiveTracker, "swanlab": SwanLabTracker,
    "trackio": TrackioTracker, "jsonl": JSONLTracker,
}

_BUILTIN = dict(LOGGER_TYPE_TO_CLASS)  # a registered class under a built-in name needs no package check

# Built-in tracker -> the pip package it needs (None: none). Availability is asked of utils.imports at call
# time (`is_<name>_available`), so it reflects the environment when the Accelerator is built.
_PACKAGE: dict[str, Optional[str]] = {
    "tensorboard": "tensorboard", "wandb": "wandb", "comet_ml": "comet_ml", "aim": "aim", "mlflow": "mlflow",
    "clearml": "clearml", "dvclive": "dvclive", "swanlab": "swanlab", "trackio": "trackio", "jsonl": None,
}


def _is_available(name: str) -> bool:
    if _PACKAGE.get(name) is None:
        return True
    return bool(getattr(_imports, f"is_{name}_available")())


def get_available_trackers() -> list[LoggerType]:
    """The built-in trackers usable here (their package is installed), in HF's order, then JSONL."""
    return [LoggerType(name) for name in _PACKAGE if _is_available(name)]


def register_tracker_class(tracker_class: type[GeneralTracker]) -> None:
    """Lets `log_with` name a custom GeneralTracker subclass by its `name`. The class is built in
    `init_trackers` as `cls(project_name, **init_kwargs[name])`, with the logging directory as a second
    positional argument when `requires_logging_directory` is true. Register before building the Accelerator."""
    if not (isinstance(tracker_class, type) and issubclass(tracker_class, GeneralTracker)):
        raise ValueError(f"`tracker_class` must be a subclass of `GeneralTracker`, but got {tracker_class}.")
    if not getattr(tracker_class, "name", None):
        raise ValueError(f"{tracker_class.__name__} must define a non-empty `name` class attribute to be registered.")
    if not hasattr(tracker_class, "requires_logging_directory"):
        raise ValueError(f"{tracker_class.__name__} must define a `requires_logging_directory` class attribute "
                         "(True when it needs a logging directory) to be registered.")
    if tracker_class.name in LOGGER_TYPE_TO_CLASS:
        warnings.warn(f"A tracker named {tracker_class.name!r} is already registered; {tracker_class} replaces it.",
                      stacklevel=2)
    LOGGER_TYPE_TO_CLASS[tracker_class.name] = tracker_class


def _needs_directory(name: str, logging_dir: Optional[Union[str, os.PathLike]]) -> None:
    if LOGGER_TYPE_TO_CLASS[name].requires_logging_directory and logging_dir is None:
        raise ValueError(f"Logging with `{name}` requires a `logging_dir` to be passed in: give the Accelerator "
                         "`project_dir=...` or `project_config=ProjectConfiguration(logging_dir=...)`.")


def filter_trackers(log_with: Any, logging_dir: Optional[Union[str, os.PathLike]] = None) -> list:
    """`log_with` (a name, a LoggerType, a GeneralTracker instance, or a list of them) as a list of
    LoggerType members / registered names / GeneralTracker instances, without repeats.

    "all" means every available built-in tracker plus the instances given. Raises ValueError for an unknown
    name or a tracker that needs `logging_dir` without one, and ImportError naming the package when a
    tracker asked for by name is not installed."""
    if log_with is None:
        return []
    if not isinstance(log_with, (list, tuple)):
        log_with = [log_with]
    instances = [t for t in log_with if isinstance(t, GeneralTracker)]
    if any(t == "all" or t == LoggerType.ALL for t in log_with if not isinstance(t, GeneralTracker)):
        chosen = instances + [t for t in get_available_trackers() if t not in instances]
    else:
        chosen = []
        for entry in log_with:
            if isinstance(entry, GeneralTracker):
                chosen.append(entry)
                continue
            name = str(entry.value if isinstance(entry, LoggerType) else entry)
            if name not in LOGGER_TYPE_TO_CLASS:
                allowed = LoggerType.list() + sorted(set(LOGGER_TYPE_TO_CLASS) - set(LoggerType.list()))
                raise ValueError(f"Unsupported logging capability: {entry!r}. Choose between {allowed}, or pass "
                                 "GeneralTracker instances.")
            key: Any = LoggerType(name) if name in LoggerType else name
            if key in chosen:
                continue
            if LOGGER_TYPE_TO_CLASS[name] is _BUILTIN.get(name) and not _is_available(name):
                raise ImportError(f"log_with={name!r}: the {name} tracker needs the `{_PACKAGE[name]}` package, "
                                  f"which is not installed (pip install {_PACKAGE[name]}).", name=_PACKAGE[name])
            chosen.append(key)
    for entry in chosen:
        if not isinstance(entry, GeneralTracker):
            _needs_directory(str(entry), logging_dir)
    return chosen


__all__ = ["AimTracker", "ClearMLTracker", "CometMLTracker", "DVCLiveTracker", "GeneralTracker", "JSONLTracker",
           "LOGGER_TYPE_TO_CLASS", "MLflowTracker", "SwanLabTracker", "TensorBoardTracker", "TrackioTracker",
           "WandBTracker", "filter_trackers", "get_available_trackers", "on_main_process", "plain_values",
           "read_jsonl", "register_tracker_class"]
