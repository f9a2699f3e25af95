# accelerate_c/tracking/mlops.py: trackers backed by MLOps platforms' packages (mlflow, clearml, dvclive),
# making the same calls into those packages as HF Accelerate 1.15; each package is imported only when used.
# These APIs record numbers only: other values are dropped with a one-time warning, as HF does.
# Not for: wandb-style trackers (hosted.py); deciding whether a package is installed (tracking/__init__.py).
from __future__ import annotations

import json
import os
from typing import Any, Optional, Union

from ..runtime.logging import get_logger
from ..base.imports import str_to_bool
from .base import GeneralTracker, on_main_process, plain_values

logger = get_logger(__name__)


def _numbers_only(tracker: str, values: dict) -> dict:
    """The int/float entries of `values`; the others are dropped with a one-time warning (HF's rule for
    trackers whose API takes numbers only)."""
    kept = {}
    for key, value in plain_values(values).items():
        if isinstance(value, (int, float)):
            kept[key] = value
        else:
            logger.warning_once(f'{tracker}: dropped "{key}" (a {type(value).__name__}, {value!r}): it only '
                                "records int and float values")
    return kept


class MLflowTracker(GeneralTracker):
    """mlflow: finds or creates the experiment, then `mlflow.start_run(...)`. The MLFLOW_EXPERIMENT_NAME,
    MLFLOW_RUN_ID, MLFLOW_TAGS (JSON) and MLFLOW_NESTED_RUN environment variables win over the arguments."""

    name = "mlflow"
    requires_logging_directory = False

    def __init__(self, experiment_name: Optional[str] = None, logging_dir: Optional[Union[str, os.PathLike]] = None,
                 run_id: Optional[str] = None, tags: Optional[Union[dict, str]] = None,
                 nested_run: Optional[bool] = False, run_name: Optional[str] = None,
                 description: Optional[str] = None) -> None:
        super().__init__()
        tags = os.environ.get("MLFLOW_TAGS", tags)
        nested_run = os.environ.get("MLFLOW_NESTED_RUN", nested_run)
        self.experiment_name = os.environ.get("MLFLOW_EXPERIMENT_NAME", experiment_name)
        self.logging_dir = logging_dir
        self.run_id = os.environ.get("MLFLOW_RUN_ID", run_id)
        self.tags = json.loads(tags) if isinstance(tags, str) else tags
        self.nested_run = str_to_bool(nested_run) == 1 if isinstance(nested_run, str) else nested_run
        self.run_name = run_name
        self.description = description
        self.active_run: Any = None

    @on_main_process
    def start(self) -> None:
        import mlflow

        found = mlflow.search_experiments(filter_string=f"name = '{self.experiment_name}'")
        if len(found) > 1:
            logger.warning(f"mlflow: {len(found)} experiments are named {self.experiment_name!r}; using the first")
        if found:
            experiment_id = found[0].experiment_id
        else:
            experiment_id = mlflow.create_experiment(name=self.experiment_name, artifact_location=self.logging_dir,
                                                     tags=self.tags)
        self.active_run = mlflow.start_run(run_id=self.run_id, experiment_id=experiment_id, run_name=self.run_name,
                                           nested=self.nested_run, tags=self.tags, description=self.description)

    @property
    def tracker(self) -> Any:
        return self.active_run

    @on_main_process
    def store_init_configuration(self, values: dict) -> None:
        import mlflow

        limits = mlflow.utils.validation
        params = []
        for key, value in values.items():
            if len(str(value)) > limits.MAX_PARAM_VAL_LENGTH:
                logger.warning_once(f'mlflow: dropped parameter "{key}": its value is longer than '
                                    f"{limits.MAX_PARAM_VAL_LENGTH} characters, mlflow's limit")
            else:
                params.append((key, value))
        batch = limits.MAX_PARAMS_TAGS_PER_BATCH  # mlflow refuses larger batches
        for i in range(0, len(params), batch):
            mlflow.log_params(dict(params[i:i + batch]))

    @on_main_process
    def log(self, values: dict, step: Optional[int] = None, **kwargs: Any) -> None:
        import mlflow

        mlflow.log_metrics(_numbers_only("mlflow", values), step=step, **kwargs)

    @on_main_process
    def log_figure(self, figure: Any, artifact_file: str, **save_kwargs: Any) -> None:
        import mlflow

        mlflow.log_figure(figure=figure, artifact_file=artifact_file, **save_kwargs)

    @on_main_process
    def log_artifacts(self, local_dir: str, artifact_path: Optional[str] = None) -> None:
        import mlflow

        mlflow.log_artifacts(local_dir=local_dir, artifact_path=artifact_path)

    @on_main_process
    def log_artifact(self, local_path: str, artifact_path: Optional[str] = None) -> None:
        import mlflow

        mlflow.log_artifact(local_path=local_path, artifact_path=artifact_path)

    @on_main_process
    def finish(self) -> None:
        import mlflow

        mlflow.end_run()


class ClearMLTracker(GeneralTracker):
    """clearml: reuses `Task.current_task()` when one exists, else `Task.init(project_name=, task_name=)`
    (CLEARML_PROJECT / CLEARML_TASK, else run_name). Keys prefixed eval_/test_/train_ go to that series."""

    name = "clearml"
    requires_logging_directory = False

    def __init__(self, run_name: Optional[str] = None, **kwargs: Any) -> None:
        super().__init__()
        self.user_provided_run_name = run_name
        self._initialized_externally = False
        self.init_kwargs = kwargs
        self.task: Any = None

    @on_main_process
    def start(self) -> None:
        from clearml import Task

        current = Task.current_task()
        if current:
            self._initialized_externally, self.task = True, current
            return
        args = dict(self.init_kwargs)
        args.setdefault("project_name", os.environ.get("CLEARML_PROJECT", self.user_provided_run_name))
        args.setdefault("task_name", os.environ.get("CLEARML_TASK", self.user_provided_run_name))
        self.task = Task.init(**args)

    @property
    def tracker(self) -> Any:
        return self.task

    @on_main_process
    def store_init_configuration(self, values: dict) -> Any:
        return self.task.connect_configuration(values)

    @staticmethod
    def _get_title_series(name: str) -> tuple[str, str]:
        for prefix in ("eval", "test", "train"):
            if name.startswith(prefix + "_"):
                return name[len(prefix) + 1:], prefix
        return name, "train"

    @on_main_process
    def log(self, values: dict, step: Optional[int] = None, **kwargs: Any) -> None:
        report = self.task.get_logger()
        for key, value in _numbers_only("clearml", values).items():
            if step is None:
                report.report_single_value(name=key, value=value, **kwargs)
            else:
                title, series = self._get_title_series(key)
                report.report_scalar(title=title, series=series, value=value, iteration=step, **kwargs)

    @on_main_process
    def log_images(self, values: dict, step: Optional[int] = None, **kwargs: Any) -> None:
        report = self.task.get_logger()
        for key, image in values.items():
            title, series = self._get_title_series(key)
            report.report_image(title=title, series=series, iteration=step, image=image, **kwargs)

    @on_main_process
    def log_table(self, table_name: str, columns: Optional[list] = None, data: Optional[list] = None,
                  dataframe: Any = None, step: Optional[int] = None, **kwargs: Any) -> None:
        table = dataframe
        if table is None:
            if data is None:
                raise ValueError("ClearMLTracker.log_table needs `data` when `dataframe` is None")
            table = [columns] + data if columns else data
        title, series = self._get_title_series(table_name)
        self.task.get_logger().report_table(title=title, series=series, table_plot=table, iteration=step, **kwargs)

    @on_main_process
    def finish(self) -> None:
        if self.task and not self._initialized_externally:  # a task the user opened is the user's to close
            self.task.close()


class DVCLiveTracker(GeneralTracker):
    """dvclive: `dvclive.Live(**kwargs)` (or the `live` object given); run_name is not used by dvclive."""

    name = "dvclive"
    requires_logging_directory = False

    def __init__(self, run_name: Optional[str] = None, live: Any = None, **kwargs: Any) -> None:
        super().__init__()
        self.live = live
        self.init_kwargs = kwargs

    @on_main_process
    def start(self) -> None:
        from dvclive import Live

        if self.live is None:
            self.live = Live(**self.init_kwargs)

    @property
    def tracker(self) -> Any:
        return self.live

    @on_main_process
    def store_init_configuration(self, values: dict) -> None:
        self.live.log_params(values)

    @on_main_process
    def log(self, values: dict, step: Optional[int] = None, **kwargs: Any) -> None:
        from dvclive.plots import Metric

        if step is not None:
            self.live.step = step
        for key, value in plain_values(values).items():
            if Metric.could_log(value):
                self.live.log_metric(key, value, **kwargs)
            else:
                logger.warning_once(f'dvclive: dropped "{key}" (a {type(value).__name__}): '
                                    "Live.log_metric cannot record it")
        self.live.next_step()

    @on_main_process
    def finish(self) -> None:
        self.live.end()


__all__ = ["ClearMLTracker", "DVCLiveTracker", "MLflowTracker"]
