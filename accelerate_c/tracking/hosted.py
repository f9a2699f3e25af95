# accelerate_c/tracking/hosted.py: trackers backed by experiment-tracking services' packages (wandb,
# trackio, swanlab, comet_ml, aim), making the same calls into those packages as HF Accelerate 1.15.
# Each package is imported inside start()/the method that needs it, never at import time: importing
# accelerate_c.tracking must not pay for (or require) any of them.
# Not for: mlflow/clearml/dvclive (mlops.py); deciding whether a package is installed (tracking/__init__.py).
from __future__ import annotations

import os
from typing import Any, Optional, Union

from packaging.version import Version

from ..base.imports import compare_versions
from .base import GeneralTracker, on_main_process, plain_values


class _RunLogTracker(GeneralTracker):
    """Trackers whose package has `init(project=...)` returning a run with `log(values, step=)` / `finish()`,
    and a module-level `config.update(...)` (wandb, trackio, swanlab). Their methods are not main-process
    only by themselves (HF's choice: wandb can run on every rank); the Accelerator calls them on the main
    process only."""

    requires_logging_directory = False
    main_process_only = False
    package = ""

    def __init__(self, run_name: str, **kwargs: Any) -> None:
        super().__init__()
        self.run_name = run_name
        self.init_kwargs = kwargs
        self.run: Any = None

    def _module(self) -> Any:
        import importlib

        return importlib.import_module(self.package)

    @on_main_process
    def start(self) -> None:
        self.run = self._module().init(project=self.run_name, **self.init_kwargs)

    @property
    def tracker(self) -> Any:
        return self.run

    @on_main_process
    def store_init_configuration(self, values: dict) -> None:
        self._module().config.update(values, allow_val_change=True)

    @on_main_process
    def log(self, values: dict, step: Optional[int] = None, **kwargs: Any) -> None:
        self.run.log(values, step=step, **kwargs)

    @on_main_process
    def log_images(self, values: dict, step: Optional[int] = None, **kwargs: Any) -> None:
        image = self._module().Image
        for key, images in values.items():
            self.log({key: [image(img) for img in images]}, step=step, **kwargs)

    @on_main_process
    def finish(self) -> None:
        self.run.finish()


class WandBTracker(_RunLogTracker):
    """wandb: `wandb.init(project=run_name, **kwargs)`."""

    name = package = "wandb"

    @on_main_process
    def log_table(self, table_name: str, columns: Optional[list] = None, data: Optional[list] = None,
                  dataframe: Any = None, step: Optional[int] = None, **kwargs: Any) -> None:
        import wandb

        self.log({table_name: wandb.Table(columns=columns, data=data, dataframe=dataframe)}, step=step, **kwargs)


class TrackioTracker(_RunLogTracker):
    """trackio: `trackio.init(project=run_name, **kwargs)`."""

    name = package = "trackio"


class SwanLabTracker(_RunLogTracker):
    """swanlab: `swanlab.init(project=run_name, **kwargs)`; tags the run's config with the framework (as HF)."""

    name = package = "swanlab"

    @on_main_process
    def start(self) -> None:
        import swanlab

        self.run = swanlab.init(project=self.run_name, **self.init_kwargs)
        swanlab.config["FRAMEWORK"] = "🤗Accelerate"


class CometMLTracker(GeneralTracker):
    """comet_ml: `comet_ml.start(project_name=run_name, **kwargs)` (`comet_ml.Experiment` before 3.41)."""

    name = "comet_ml"
    requires_logging_directory = False

    def __init__(self, run_name: str, **kwargs: Any) -> None:
        super().__init__()
        self.run_name = run_name
        self.init_kwargs = kwargs
        self.writer: Any = None

    @on_main_process
    def start(self) -> None:
        import comet_ml

        if compare_versions(Version(comet_ml.__version__), ">=", "3.41.0"):
            self.writer = comet_ml.start(project_name=self.run_name, **self.init_kwargs)
        else:
            self.writer = comet_ml.Experiment(project_name=self.run_name, **self.init_kwargs)

    @property
    def tracker(self) -> Any:
        return self.writer

    @on_main_process
    def store_init_configuration(self, values: dict) -> None:
        self.writer.log_parameters(values)

    @on_main_process
    def log(self, values: dict, step: Optional[int] = None, **kwargs: Any) -> None:
        if step is not None:
            self.writer.set_step(step)
        for key, value in plain_values(values).items():
            if isinstance(value, (int, float)):
                self.writer.log_metric(key, value, step=step, **kwargs)
            elif isinstance(value, str):
                self.writer.log_other(key, value, **kwargs)
            elif isinstance(value, dict):
                self.writer.log_metrics(value, step=step, **kwargs)

    @on_main_process
    def finish(self) -> None:
        self.writer.end()


class AimTracker(GeneralTracker):
    """aim: `aim.Run(repo=logging_dir, **kwargs)` named `run_name`; `track(value, name=key, step=step)`."""

    name = "aim"
    requires_logging_directory = True

    def __init__(self, run_name: str, logging_dir: Optional[Union[str, os.PathLike]] = ".", **kwargs: Any) -> None:
        super().__init__()
        self.run_name = run_name
        self.aim_repo_path = logging_dir
        self.init_kwargs = kwargs
        self.writer: Any = None

    @on_main_process
    def start(self) -> None:
        from aim import Run

        self.writer = Run(repo=self.aim_repo_path, **self.init_kwargs)
        self.writer.name = self.run_name

    @property
    def tracker(self) -> Any:
        return self.writer

    @on_main_process
    def store_init_configuration(self, values: dict) -> None:
        self.writer["hparams"] = values

    @on_main_process
    def log(self, values: dict, step: Optional[int] = None, **kwargs: Any) -> None:
        for key, value in plain_values(values).items():
            self.writer.track(value, name=key, step=step, **kwargs)

    @on_main_process
    def log_images(self, values: dict, step: Optional[int] = None, kwargs: Optional[dict] = None) -> None:
        """values: name -> image or (image, caption); kwargs: {"aim_image": {...}, "track": {...}}."""
        import aim

        kwargs = kwargs or {}
        for key, value in values.items():
            img, caption = value if isinstance(value, tuple) else (value, "")
            self.writer.track(aim.Image(img, caption=caption, **kwargs.get("aim_image", {})), name=key, step=step,
                              **kwargs.get("track", {}))

    @on_main_process
    def finish(self) -> None:
        self.writer.close()


__all__ = ["AimTracker", "CometMLTracker", "SwanLabTracker", "TrackioTracker", "WandBTracker"]
