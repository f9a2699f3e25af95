# tests/test_tracking.py: experiment trackers and Accelerator.profile() against HF Accelerate 1.15:
# TensorBoard event files read back and compared with HF's on the same calls, the JSONL tracker read back,
# custom GeneralTrackers, `log_with` validation (unknown name, missing package, logging_dir), the
# third-party trackers' calls into their package (a recording fake module; HF's tracker on the same fake is
# the reference), 2 real processes (only rank 0 writes), and the profiler's chrome traces.
# Not for: get_logger (test_logging.py).
import glob
import importlib
import json
import os
import re
import sys
from unittest import mock

import numpy as np
import pytest
import torch
import yaml
from _tracking_runs import two_process_runs
from conftest import reset_state


pytestmark = pytest.mark.usefixtures("clean_state")


# ---- TensorBoard ------------------------------------------------------------------------------------------
def _read_events(root):
    """{(folder relative to root with timestamps masked, tag): [(step, value)]} for scalars and text, and
    the hparams summaries as {(folder, "_hparams_/..."): HParamsPluginData}."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams.plugin_data_pb2 import HParamsPluginData

    out = {}
    for path in sorted(glob.glob(os.path.join(root, "**", "events.out.tfevents.*"), recursive=True)):
        rel = re.sub(r"\d{9,}\.\d+", "<time>", os.path.relpath(os.path.dirname(path), root))
        acc = EventAccumulator(path, size_guidance={"scalars": 0, "tensors": 0})
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            out.setdefault((rel, tag), []).extend((e.step, round(e.value, 6)) for e in acc.Scalars(tag))
        for tag in acc.Tags()["tensors"]:
            for e in acc.Tensors(tag):
                vals = [v.decode() for v in e.tensor_proto.string_val] or [e.tensor_proto.tensor_content.hex()]
                out.setdefault((rel, tag), []).append((e.step, tuple(vals)))
        try:
            for tag, content in acc.PluginTagToContent("hparams").items():
                out[(rel, tag)] = HParamsPluginData.FromString(content)  # protobuf maps have no fixed order
        except KeyError:  # no hparams in this file
            pass
    return out


def _read_hparams(root):
    files = glob.glob(os.path.join(root, "**", "hparams.yml"), recursive=True)
    assert len(files) == 1, files
    with open(files[0]) as fh:
        return yaml.safe_load(fh)


CONFIG = {"lr": 0.01, "batch_size": 8, "optimizer": "adamw", "amp": True}


def _tensorboard_run(mod_name, project_dir):
    acc = importlib.import_module(mod_name).Accelerator(log_with="tensorboard", project_dir=project_dir)
    acc.init_trackers("tb_run", config=CONFIG)
    for step in range(4):
        acc.log({"loss": 1.0 / (step + 1), "loss_t": torch.tensor(2.0 * step), "epoch": step // 2,
                 "phase": f"phase {step % 2}", "pair": {"a": float(step), "b": -float(step)}}, step=step)
    acc.log({"final": 7.5})  # no step: TensorBoard's default
    writer = acc.get_tracker("tensorboard", unwrap=True)
    acc.end_training()
    reset_state(mod_name)
    return writer


def test_tensorboard_matches_hf(tmp_path):
    ours_writer = _tensorboard_run("accelerate_c", str(tmp_path / "ours"))
    hf_writer = _tensorboard_run("accelerate", str(tmp_path / "hf"))
    assert type(ours_writer) is type(hf_writer)
    ours = _read_events(tmp_path / "ours" / "tb_run")
    hf = _read_events(tmp_path / "hf" / "tb_run")
    assert ours == hf
    # and the values are the ones logged (the comparison above cannot pass on two empty folders)
    assert ours[(".", "loss")] == [(s, round(1.0 / (s + 1), 6)) for s in range(4)]
    assert ours[(".", "loss_t")] == [(s, 2.0 * s) for s in range(4)]
    assert ours[(".", "epoch")] == [(0, 0), (1, 0), (2, 1), (3, 1)]
    assert ours[("pair_b", "pair")] == [(s, -float(s)) for s in range(4)]
    assert [v for _, v in ours[(".", "phase/text_summary")]] == [("phase 0",), ("phase 1",)] * 2
    assert ours[(".", "final")] == [(0, 7.5)]
    hparams = ours[("<time>", "_hparams_/session_start_info")].session_start_info.hparams
    assert hparams["optimizer"].string_value == "adamw" and hparams["lr"].number_value == 0.01
    assert _read_hparams(tmp_path / "ours") == _read_hparams(tmp_path / "hf") == CONFIG


# ---- JSONL --------------------------------------------------------------------------------------------------
def test_jsonl_records(tmp_path):
    from accelerate_c import Accelerator
    from accelerate_c.tracking import read_jsonl

    acc = Accelerator(log_with="jsonl", project_dir=str(tmp_path))
    acc.init_trackers("run", config={"lr": 0.1, "tags": ["a", "b"], "path": None})
    acc.log({"loss": torch.tensor(0.25), "bf16": torch.tensor(1.5, dtype=torch.bfloat16),
             "vec": torch.arange(3), "np": np.float32(0.5), "text": "hi", "nested": {"x": torch.tensor(2)}}, step=3)
    acc.log({"nan": float("nan")})
    handle = acc.get_tracker("jsonl", unwrap=True)
    acc.end_training()
    assert handle.closed
    records = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [set(r) for r in records] == [{"config", "time"}, {"step", "values", "time"}, {"step", "values", "time"}]
    assert records[0]["config"] == {"lr": 0.1, "tags": ["a", "b"], "path": None}
    assert records[1]["step"] == 3
    assert records[1]["values"] == {"loss": 0.25, "bf16": 1.5, "vec": [0, 1, 2], "np": 0.5, "text": "hi",
                                    "nested": {"x": 2}}
    assert records[2]["step"] is None and records[2]["values"]["nan"] != records[2]["values"]["nan"]
    # a second run of the same project appends (a resumed run keeps its history)
    reset_state("accelerate_c")
    acc = Accelerator(log_with="jsonl", project_dir=str(tmp_path))
    acc.init_trackers("run")
    acc.log({"loss": 0.125}, step=4)
    acc.end_training()
    records = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert len(records) == 4 and records[-1]["values"] == {"loss": 0.125} and records[-1]["step"] == 4


def test_jsonl_tracker_before_start_is_clear(tmp_path):
    from accelerate_c import PartialState
    from accelerate_c.tracking import JSONLTracker

    PartialState()
    with pytest.raises(RuntimeError, match="init_trackers"):
        JSONLTracker("run", str(tmp_path)).log({"a": 1})


# ---- custom trackers ----------------------------------------------------------------------------------------
def _recording_tracker(base):
    class Recorder(base):
        name = "recorder"
        requires_logging_directory = False

        def __init__(self):
            super().__init__()
            self.calls = []

        @property
        def tracker(self):
            return self.calls

        def start(self):
            self.calls.append(("start",))

        def store_init_configuration(self, values):
            self.calls.append(("config", values))

        def log(self, values, step=None, **kwargs):
            self.calls.append(("log", values, step, kwargs))

        def finish(self):
            self.calls.append(("finish",))

    return Recorder()


def _custom_run(mod_name, project_dir):
    mod = importlib.import_module(mod_name)
    tracker = _recording_tracker(importlib.import_module(f"{mod_name}.tracking").GeneralTracker)
    acc = mod.Accelerator(log_with=[tracker, "tensorboard"], project_dir=project_dir)
    acc.init_trackers("p", config={"lr": 1}, init_kwargs={"tensorboard": {"flush_secs": 5}})
    acc.log({"a": 1.0}, step=2, log_kwargs={"recorder": {"commit": False}})
    acc.log({"b": "x"})
    assert acc.get_tracker("recorder") is tracker
    assert acc.get_tracker("recorder", unwrap=True) is tracker.calls
    assert acc.get_tracker("tensorboard").name == "tensorboard"
    with pytest.raises(ValueError, match="not an available tracker"):
        acc.get_tracker("wandb")
    acc.end_training()
    reset_state(mod_name)
    return tracker.calls


def test_custom_tracker_receives_calls_as_in_hf(tmp_path):
    ours = _custom_run("accelerate_c", str(tmp_path / "ours"))
    hf = _custom_run("accelerate", str(tmp_path / "hf"))
    assert ours == hf == [("start",), ("config", {"lr": 1}), ("log", {"a": 1.0}, 2, {"commit": False}),
                          ("log", {"b": "x"}, None, {}), ("finish",)]


def test_incomplete_tracker_class_is_refused():
    from accelerate_c.tracking import GeneralTracker

    class NoName(GeneralTracker):
        requires_logging_directory = False

    with pytest.raises(NotImplementedError, match="`name`, `tracker`"):
        NoName()
    GeneralTracker(_blank=True).log({"a": 1})  # the placeholder non-main ranks get: a no-op


def test_registered_tracker_class(tmp_path):
    from accelerate_c import Accelerator
    from accelerate_c.tracking import LOGGER_TYPE_TO_CLASS, GeneralTracker, register_tracker_class

    made = []

    class DirTracker(GeneralTracker):
        name = "dir_tracker"
        requires_logging_directory = True

        def __init__(self, run_name, logging_dir, **kwargs):
            super().__init__()
            made.append((run_name, logging_dir, kwargs))

        @property
        def tracker(self):
            return None

    with pytest.raises(ValueError, match="subclass of `GeneralTracker`"):
        register_tracker_class(object)
    register_tracker_class(DirTracker)
    try:
        with pytest.raises(ValueError, match="dir_tracker.*requires a `logging_dir`"):
            Accelerator(log_with="dir_tracker")
        acc = Accelerator(log_with="dir_tracker", project_dir=str(tmp_path))
        acc.init_trackers("proj", init_kwargs={"dir_tracker": {"k": 1}})
        assert made == [("proj", str(tmp_path), {"k": 1})]
        assert acc.get_tracker("dir_tracker").name == "dir_tracker"
    finally:
        LOGGER_TYPE_TO_CLASS.pop("dir_tracker", None)


# ---- log_with validation ------------------------------------------------------------------------------------
def test_missing_package_names_tracker_and_package(monkeypatch, tmp_path):
    import accelerate_c.utils.imports as imports
    from accelerate_c import Accelerator

    monkeypatch.setattr(imports, "is_wandb_available", lambda: False)
    monkeypatch.setattr(imports, "is_mlflow_available", lambda: False)
    with pytest.raises(ImportError, match=r"wandb tracker needs the `wandb` package, which is not installed") as err:
        Accelerator(log_with="wandb")
    assert err.value.name == "wandb"
    with pytest.raises(ImportError, match="mlflow"):
        Accelerator(log_with=["jsonl", "mlflow"], project_dir=str(tmp_path))


def test_unknown_name_lists_allowed():
    from accelerate_c import Accelerator

    with pytest.raises(ValueError, match=r"Unsupported logging capability: 'tensorbord'.*'tensorboard'.*'jsonl'"):
        Accelerator(log_with="tensorbord")


@pytest.mark.parametrize("log_with", ["tensorboard", "jsonl", "all", ["wandb_off", "aim"]])
def test_logging_dir_required_at_construction(monkeypatch, log_with):
    import accelerate_c.utils.imports as imports
    from accelerate_c import Accelerator

    monkeypatch.setattr(imports, "is_aim_available", lambda: True)
    if isinstance(log_with, list):
        log_with = log_with[1:]
    with pytest.raises(ValueError, match=r"requires a `logging_dir`.*project_dir"):
        Accelerator(log_with=log_with)
    if log_with == "tensorboard":  # HF refuses it at construction too
        reset_state("accelerate_c")
        import accelerate

        with pytest.raises(ValueError, match="requires a `logging_dir`"):
            accelerate.Accelerator(log_with=log_with)


def test_all_selects_the_installed_trackers(monkeypatch, tmp_path):
    import accelerate_c.utils.imports as imports
    from accelerate_c import Accelerator
    from accelerate_c.utils import LoggerType

    for name in ("wandb", "comet_ml", "aim", "mlflow", "clearml", "dvclive", "swanlab", "trackio"):
        monkeypatch.setattr(imports, f"is_{name}_available", lambda: False)
    monkeypatch.setattr(imports, "is_mlflow_available", lambda: True)
    custom = _recording_tracker(importlib.import_module("accelerate_c.tracking").GeneralTracker)
    acc = Accelerator(log_with=[LoggerType.ALL, custom, "tensorboard"], project_dir=str(tmp_path))
    assert acc.log_with == [custom, LoggerType.TENSORBOARD, LoggerType.MLFLOW, LoggerType.JSONL]
    reset_state("accelerate_c")
    acc = Accelerator(log_with=["jsonl", LoggerType.JSONL, "tensorboard"], project_dir=str(tmp_path))
    assert acc.log_with == [LoggerType.JSONL, LoggerType.TENSORBOARD]


# ---- third-party trackers through a recording fake package --------------------------------------------------
def _fake_package(name):
    fake = mock.MagicMock(name=name)
    modules = {name: fake}
    if name == "comet_ml":
        fake.__version__ = "3.45.0"
    elif name == "mlflow":
        fake.search_experiments.return_value = []
        fake.create_experiment.return_value = "exp-1"
        fake.utils.validation.MAX_PARAM_VAL_LENGTH = 20
        fake.utils.validation.MAX_PARAMS_TAGS_PER_BATCH = 2
    elif name == "clearml":
        fake.Task.current_task.return_value = None
    elif name == "dvclive":
        fake.plots.Metric.could_log.side_effect = lambda v: isinstance(v, (int, float))
        modules["dvclive.plots"] = fake.plots
    return fake, modules


# tracker -> (kwargs for its constructor via init_kwargs, needs logging_dir)
HOSTED = {"wandb": ({"entity": "me"}, False), "trackio": ({"space_id": "s"}, False), "swanlab": ({}, False),
          "comet_ml": ({"workspace": "w"}, False), "aim": ({"experiment": "e"}, True),
          "mlflow": ({"tags": {"t": "1"}, "run_name": "r1"}, False), "clearml": ({"tags": ["x"]}, False),
          "dvclive": ({"dir": "dvc"}, False)}
HOSTED_CONFIG = {"lr": 0.1, "long_text": "x" * 40, "a": 1, "b": 2}
HOSTED_LOGS = [({"loss": 0.5, "acc": 2, "note": "hello", "eval_f1": 0.25}, 1), ({"loss": 0.25}, None)]


def _hosted_run(mod_name, name, project_dir, monkeypatch):
    fake, modules = _fake_package(name)
    for mod, obj in modules.items():
        monkeypatch.setitem(sys.modules, mod, obj)
    kwargs, needs_dir = HOSTED[name]
    acc_mod = importlib.import_module(mod_name)
    if mod_name == "accelerate_c":
        import accelerate_c.utils.imports as imports

        monkeypatch.setattr(imports, f"is_{name}_available", lambda: True)
        acc = acc_mod.Accelerator(log_with=name, project_dir=project_dir)
        acc.init_trackers("proj", config=HOSTED_CONFIG, init_kwargs={name: kwargs})
    else:  # HF only builds trackers whose package it found at import: give it an instance of its class
        cls = importlib.import_module("accelerate.tracking").LOGGER_TYPE_TO_CLASS[name]
        tracker = cls("proj", project_dir, **kwargs) if needs_dir else cls("proj", **kwargs)
        acc = acc_mod.Accelerator(log_with=[tracker], project_dir=project_dir)
        acc.init_trackers("proj", config=HOSTED_CONFIG)
    for values, step in HOSTED_LOGS:
        acc.log(values, step=step)
    acc.end_training()
    reset_state(mod_name)
    return fake.mock_calls


@pytest.mark.parametrize("name", sorted(HOSTED))
def test_hosted_tracker_calls_match_hf(name, tmp_path, monkeypatch):
    ours = _hosted_run("accelerate_c", name, str(tmp_path), monkeypatch)
    hf = _hosted_run("accelerate", name, str(tmp_path), monkeypatch)
    assert len(ours) >= 4, ours  # start, config, two logs, finish at least
    assert ours == hf


def test_hosted_numbers_only_trackers_take_tensors(tmp_path, monkeypatch):
    """mlflow/clearml/comet/aim/dvclive get Python numbers for tensors (HF would drop them for mlflow)."""
    import accelerate_c.utils.imports as imports
    from accelerate_c import Accelerator

    fake, modules = _fake_package("mlflow")
    monkeypatch.setitem(sys.modules, "mlflow", fake)
    monkeypatch.setattr(imports, "is_mlflow_available", lambda: True)
    acc = Accelerator(log_with="mlflow")
    acc.init_trackers("proj")
    acc.log({"loss": torch.tensor(0.5), "n": np.int64(3), "s": "dropped"}, step=7)
    acc.end_training()
    fake.log_metrics.assert_called_once_with({"loss": 0.5, "n": 3}, step=7)


# ---- 2 processes --------------------------------------------------------------------------------------------
def test_two_processes_only_rank0_writes(tmp_path_factory):
    runs = two_process_runs(tmp_path_factory)
    ours, hf = runs["accelerate_c"], runs["accelerate"]
    for out in (ours, hf):
        states = [json.load(open(os.path.join(out, f"state{r}.json"))) for r in range(2)]
        assert states[1] == {"n_trackers": 0, "names": [], "get_tracker_blank": True}, out
        assert states[0]["n_trackers"] >= 1 and not states[0]["get_tracker_blank"], out
    # one event file + one hparams run: rank 1 created no writer
    assert len(glob.glob(os.path.join(ours, "logs", "run", "events.out.tfevents.*"))) == 1
    tb_ours, tb_hf = _read_events(os.path.join(ours, "logs", "run")), _read_events(os.path.join(hf, "logs", "run"))
    assert tb_ours == tb_hf
    assert tb_ours[(".", "rank")] == [(0, 0.0), (1, 0.0), (2, 0.0)]  # rank 1's values never reached the file
    from accelerate_c.tracking import read_jsonl

    records = read_jsonl(os.path.join(ours, "logs", "run", "metrics.jsonl"))
    assert records[0]["config"] == {"lr": 0.5, "world": 2}
    assert [(r["step"], r["values"]["rank"]) for r in records[1:]] == [(0, 0.0), (1, 0.0), (2, 0.0)]


def _trace_events(path):
    with open(path) as fh:
        trace = json.load(fh)
    return [e for e in trace["traceEvents"] if e.get("ph") == "X"]


def test_two_processes_profile_traces(tmp_path_factory):
    runs = two_process_runs(tmp_path_factory)
    for impl, out in runs.items():
        files = sorted(os.listdir(os.path.join(out, "trace")))
        assert files == ["profile_0.json", "profile_1.json"], (impl, files)  # HF's rule: every rank, its index
        for f in files:
            names = {e["name"] for e in _trace_events(os.path.join(out, "trace", f))}
            assert "aten::linear" in names, (impl, f, sorted(names)[:20])


# ---- profile() ----------------------------------------------------------------------------------------------
def _profile_run(mod_name, trace_dir):
    mod = importlib.import_module(mod_name)
    acc = mod.Accelerator(kwargs_handlers=[mod.ProfileKwargs(output_trace_dir=trace_dir, record_shapes=True)])
    model = torch.nn.Linear(8, 4)
    with acc.profile() as prof:
        model(torch.randn(3, 8)).sum().backward()
    ops = {e.key for e in prof.key_averages()}
    ready = []
    handler = mod.ProfileKwargs(schedule_option={"wait": 1, "warmup": 1, "active": 2, "repeat": 1},
                                on_trace_ready=lambda p: ready.append(len(p.key_averages()) > 0))
    with acc.profile(handler) as prof:  # the argument wins over the Accelerator's handler: no trace file
        for _ in range(6):
            model(torch.randn(3, 8)).sum()
            prof.step()
    reset_state(mod_name)
    return ops, ready


def test_profile_writes_trace_like_hf(tmp_path):
    ours_ops, ours_ready = _profile_run("accelerate_c", str(tmp_path / "ours"))
    hf_ops, hf_ready = _profile_run("accelerate", str(tmp_path / "hf"))
    assert os.listdir(tmp_path / "ours") == os.listdir(tmp_path / "hf") == ["profile_0.json"]
    events = _trace_events(tmp_path / "ours" / "profile_0.json")
    names = {e["name"] for e in events}
    assert {"aten::linear", "aten::sum"} <= names and "aten::linear" in ours_ops
    assert any("Input Dims" in e.get("args", {}) for e in events)  # record_shapes reached the profiler
    assert ours_ready == hf_ready == [True]


def test_profile_kwargs_validation():
    from accelerate_c import ProfileKwargs

    with pytest.raises(ValueError, match="Invalid profiler activity: gpu"):
        ProfileKwargs(activities=["cpu", "gpu"]).build()
    with pytest.raises(ValueError, match=r"missing: \['active'\]"):
        ProfileKwargs(schedule_option={"wait": 1, "warmup": 1}).build()
    with pytest.raises(ValueError, match=r"unknown: \['wiat'\]"):
        ProfileKwargs(schedule_option={"wiat": 1, "wait": 1, "warmup": 1, "active": 1}).build()
    prof = ProfileKwargs(activities=["cpu"], schedule_option={"wait": 0, "warmup": 1, "active": 1}).build()
    assert isinstance(prof, torch.profiler.profile)
