# accelerate_c/tracking/local.py: the trackers that write files under the logging directory:
# TensorBoard (torch.utils.tensorboard.SummaryWriter, HF Accelerate 1.15's behaviour) and JSONL (ours, no
# package needed: one JSON object per line, easy to read back with any language).
# Not for: trackers that talk to a service (hosted.py) or choosing trackers (tracking/__init__.py).
from __future__ import annotations

import json
import os
import time
from typing import Any, Optional, Union

from .base import GeneralTracker, on_main_process, plain_values


class TensorBoardTracker(GeneralTracker):
    """Writes event files to `<logging_dir>/<run_name>`; extra kwargs go to `SummaryWriter`."""

    name = "tensorboard"
    requires_logging_directory = True

    def __init__(self, run_name: str, logging_dir: Union[str, os.PathLike], **kwargs: Any) -> None:
        super().__init__()
        self.run_name = run_name
        self.logging_dir_param = logging_dir
        self.init_kwargs = kwargs
        self.writer: Any = None

    @on_main_process
    def start(self) -> None:
        try:
            from torch.utils import tensorboard
        except ModuleNotFoundError:  # torch's writer needs the tensorboard package; tensorboardX has its own
            import tensorboardX as tensorboard
        self.logging_dir = os.path.join(self.logging_dir_param, self.run_name)
        self.writer = tensorboard.SummaryWriter(self.logging_dir, **self.init_kwargs)

    @property
    def tracker(self) -> Any:
        return self.writer

    @on_main_process
    def store_init_configuration(self, values: dict) -> None:
        """hparams in the event file, plus `<logging_dir>/<run_name>/<unix time>/hparams.yml` (as HF)."""
        import yaml

        self.writer.add_hparams(values, metric_dict={})
        self.writer.flush()
        run_dir = os.path.join(self.logging_dir, str(time.time()))
        os.makedirs(run_dir, exist_ok=True)
        with open(os.path.join(run_dir, "hparams.yml"), "w") as fh:
            yaml.dump(values, fh)

    @on_main_process
    def log(self, values: dict, step: Optional[int] = None, **kwargs: Any) -> None:
        """Numbers → add_scalar, strings → add_text, dicts of numbers → add_scalars; other types are skipped
        (HF's rule). kwargs go to those SummaryWriter methods."""
        for key, value in plain_values(values).items():
            if isinstance(value, (int, float)):
                self.writer.add_scalar(key, value, global_step=step, **kwargs)
            elif isinstance(value, str):
                self.writer.add_text(key, value, global_step=step, **kwargs)
            elif isinstance(value, dict):
                self.writer.add_scalars(key, value, global_step=step, **kwargs)
        self.writer.flush()

    @on_main_process
    def log_images(self, values: dict, step: Optional[int] = None, **kwargs: Any) -> None:
        for key, images in values.items():
            self.writer.add_images(key, images, global_step=step, **kwargs)

    @on_main_process
    def finish(self) -> None:
        self.writer.close()


def _json_default(value: Any) -> Any:
    # Anything plain_values left alone (a Path, a dtype, a custom object) is written as its text.
    return str(value)


class JSONLTracker(GeneralTracker):
    """Appends to `<logging_dir>/<run_name>/metrics.jsonl`, one JSON object per line:

    - `{"config": {...}, "time": t}` for `store_init_configuration`,
    - `{"step": s, "values": {...}, "time": t}` for each `log` call (`step` is null when not given).

    Tensors and numpy values become numbers (lists when not 0-d); NaN/inf are written as Python's json
    module writes them (`NaN`, `Infinity`), which `json.loads` reads back. Appending means a resumed run
    continues the same file; each run starts with its config record when a config is given.
    kwargs: `filename` (default "metrics.jsonl").
    """

    name = "jsonl"
    requires_logging_directory = True

    def __init__(self, run_name: str, logging_dir: Union[str, os.PathLike], filename: str = "metrics.jsonl") -> None:
        super().__init__()
        self.run_name = run_name
        self.logging_dir_param = logging_dir
        self.filename = filename
        self.path: Optional[str] = None
        self._fh: Any = None

    @on_main_process
    def start(self) -> None:
        run_dir = os.path.join(self.logging_dir_param, self.run_name)
        os.makedirs(run_dir, exist_ok=True)
        self.path = os.path.join(run_dir, self.filename)
        self._fh = open(self.path, "a", encoding="utf-8")

    @property
    def tracker(self) -> Any:
        return self._fh

    def _write(self, record: dict) -> None:
        if self._fh is None:
            raise RuntimeError("JSONLTracker: call Accelerator.init_trackers (or start()) before logging")
        record["time"] = time.time()
        # One write per record, flushed at once: a crash loses at most the record being written.
        self._fh.write(json.dumps(record, default=_json_default) + "\n")
        self._fh.flush()

    @on_main_process
    def store_init_configuration(self, values: dict) -> None:
        self._write({"config": plain_values(values)})

    @on_main_process
    def log(self, values: dict, step: Optional[int] = None, **kwargs: Any) -> None:
        self._write({"step": None if step is None else int(step), "values": plain_values(values)})

    @on_main_process
    def finish(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None


def read_jsonl(path: Union[str, os.PathLike]) -> list[dict]:
    """The records of a JSONL tracker file, in order (a convenience for analysis and tests)."""
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


__all__ = ["JSONLTracker", "TensorBoardTracker", "read_jsonl"]
