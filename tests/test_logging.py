# tests/test_logging.py: accelerate_c.logging.get_logger against HF Accelerate 1.15's on the same calls:
# the error before any state exists, record text/level/caller on one process, warning_once, the level from
# ACCELERATE_LOG_LEVEL, and on 2 real processes main_process_only (default), main_process_only=False and
# in_order=True (each rank's output and the shared in-order file compared with HF's).
# Not for: trackers (test_tracking.py).
import importlib
import logging
import os

import pytest
from _tracking_runs import two_process_runs
from conftest import reset_state


@pytest.fixture(autouse=True)
def clean(clean_state):
    root_level = logging.getLogger().level
    yield
    logging.getLogger().setLevel(root_level)


def test_error_before_state_matches_hf():
    texts = []
    for mod_name in ("accelerate_c", "accelerate"):
        logger = importlib.import_module(f"{mod_name}.logging").get_logger(f"before_state_{mod_name}")
        with pytest.raises(RuntimeError, match=r"You must initialize the accelerate state by calling either "
                                               r"`PartialState\(\)` or `Accelerator\(\)`") as err:
            logger.info("too early")
        texts.append(str(err.value))
    assert texts[0] == texts[1]


class _Collect(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records = []

    def emit(self, record):
        self.records.append((record.levelname, record.getMessage(), record.funcName,
                             os.path.basename(record.pathname)))


def _emit_all(logger):
    logger.info("hello %s", "world")
    logger.debug("debug line", main_process_only=False)
    logger.info("in order", in_order=True)
    logger.warning_once("only once")
    logger.warning_once("only once")
    logger.error("err", main_process_only=True)


def _single_process_records(mod_name, level):
    importlib.import_module(f"{mod_name}.state").PartialState(cpu=True)
    logger = importlib.import_module(f"{mod_name}.logging").get_logger(f"single_{mod_name}_{level}", log_level=level)
    collect = _Collect()
    logger.logger.addHandler(collect)
    logger.logger.propagate = False
    try:
        _emit_all(logger)
    finally:
        logger.logger.removeHandler(collect)
    reset_state(mod_name)
    return collect.records


@pytest.mark.parametrize("level", ["debug", "INFO", "error"])
def test_single_process_records_match_hf(level):
    ours = _single_process_records("accelerate_c", level)
    hf = _single_process_records("accelerate", level)
    assert ours == hf
    expected = [("INFO", "[RANK 0] hello world"), ("DEBUG", "[RANK 0] debug line"), ("INFO", "[RANK 0] in order"),
                ("WARNING", "[RANK 0] only once"), ("ERROR", "[RANK 0] err")]
    threshold = logging.getLevelName(level.upper())
    assert [r[:2] for r in ours] == [e for e in expected if logging.getLevelName(e[0]) >= threshold]
    # the caller is the user's function, not the adapter (warning_once's extra frame is HF's too)
    assert {r[2] for r in ours if r[1] != "[RANK 0] only once"} == {"_emit_all"}


def test_log_level_from_environment(monkeypatch):
    from accelerate_c import PartialState
    from accelerate_c.logging import get_logger

    PartialState(cpu=True)
    monkeypatch.setenv("ACCELERATE_LOG_LEVEL", "debug")
    assert get_logger("env_level").logger.level == logging.DEBUG
    assert get_logger("arg_level", log_level="warning").logger.level == logging.WARNING  # the argument wins
    monkeypatch.setenv("ACCELERATE_LOG_LEVEL", "chatty")
    with pytest.raises(ValueError, match="unknown ACCELERATE_LOG_LEVEL 'chatty'"):
        get_logger("bad_level")
    with pytest.raises(ValueError, match="unknown log_level 'loud'"):
        get_logger("bad_level", log_level="loud")


def _lines(path):
    with open(path) as fh:
        return fh.read().splitlines()


def test_two_processes_main_only_and_in_order(tmp_path_factory):
    runs = two_process_runs(tmp_path_factory)
    ours, hf = runs["accelerate_c"], runs["accelerate"]
    for rank in range(2):
        assert _lines(os.path.join(ours, f"rank{rank}.log")) == _lines(os.path.join(hf, f"rank{rank}.log")), rank
    assert _lines(os.path.join(ours, "rank0.log")) == [
        "INFO [RANK 0] main only", "WARNING [RANK 0] every rank",
        "INFO [RANK 0] in order 0", "INFO [RANK 0] in order 1", "INFO [RANK 0] in order 2"]
    assert _lines(os.path.join(ours, "rank1.log")) == [
        "WARNING [RANK 1] every rank", "INFO [RANK 1] in order 0", "INFO [RANK 1] in order 1",
        "INFO [RANK 1] in order 2"]
    # both ranks append to order.log: with in_order the ranks take turns, rank 0 first, for every message
    expected = [f"INFO [RANK {r}] in order {k}" for k in range(3) for r in range(2)]
    for out in (ours, hf):
        assert [ln for ln in _lines(os.path.join(out, "order.log")) if "in order" in ln] == expected, out
