# tests/test_launchers.py: notebook_launcher / debug_launcher. A plain function trains a small model on 2 forked
# processes (tests/scripts/launcher_train.py, run as a subprocess with a timeout) and must end where the same
# function ends in one process with the global batch; a rank that raises must stop its peer and surface in the
# caller naming the failing rank, with nothing left in the caller's temp dir; HF's argument errors.
# Not for: `accelerate_c launch` (test_launch.py).
import importlib
import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import ROOT, SCRIPTS, alive, clean_env, free_port, reset_state

SCRIPT = os.path.join(SCRIPTS, "launcher_train.py")


def _run(mode: str, out, timeout: float = 180, **env: str) -> None:
    log = os.path.join(out, f"{mode}.log")
    with open(log, "w") as fh:
        proc = subprocess.run([sys.executable, SCRIPT, mode, str(out), str(free_port())], env=clean_env(**env),
                              stdout=fh, stderr=subprocess.STDOUT, cwd=ROOT, timeout=timeout)
    text = open(log).read()
    assert proc.returncode == 0, f"{mode} exited {proc.returncode}:\n{text[-6000:]}"
    return text


def _load(out, tag: str, rank: int) -> dict:
    with open(os.path.join(out, f"{tag}_r{rank}.json")) as fh:
        return json.load(fh)


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    out = tmp_path_factory.mktemp("single")
    _run("single", out)
    return _load(out, "single", 0)


@pytest.mark.parametrize("mode", ["notebook", "debug"])
def test_two_processes_match_one_process(mode, tmp_path, single):
    tmpdir = tmp_path / "tmp"  # the launcher's folder (base/leftovers.py naming) lives here and is gone after
    tmpdir.mkdir()
    log = _run(mode, tmp_path, ACCELERATE_DEBUG_MODE="true" if mode == "notebook" else "false", TMPDIR=str(tmpdir),
               TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "torch-cache"))
    assert os.listdir(tmpdir) == [], os.listdir(tmpdir)
    ranks = [_load(tmp_path, mode, r) for r in range(2)]
    for r, rec in enumerate(ranks):
        assert (rec["rank"], rec["world"], rec["local"]) == (r, 2, r), (rec, log[-3000:])
        assert rec["distributed_type"] == "MULTI_CPU" and rec["mixed_precision"] == "no"
        assert rec["wrapped"] and rec["unwrapped_is_model"], "unwrap_model must return the user's module"
        assert rec["tqdm_disabled"] == (r != 0), "tqdm shows on the local main process only"
        # the same global batches as the single run (4 per rank vs 8): same losses and parameters
        torch.testing.assert_close(torch.tensor(rec["losses"]), torch.tensor(single["losses"]), rtol=1e-5, atol=1e-6)
        for got, ref in zip(rec["params"], single["params"]):
            torch.testing.assert_close(torch.tensor(got), torch.tensor(ref), rtol=1e-5, atol=1e-6)
    assert ranks[0]["params"] == ranks[1]["params"], "ranks diverged"
    assert os.path.exists(tmp_path / f"{mode}_save_r0.pt") and not os.path.exists(tmp_path / f"{mode}_save_r1.pt")
    if mode == "notebook":  # second launch from the same caller, mixed_precision reaches the ranks
        assert [_load(tmp_path, "bf16", r) for r in range(2)] == [{"mixed_precision": "bf16", "world": 2}] * 2


def test_single_process_runs_in_the_caller(single):
    assert (single["world"], single["wrapped"], single["tqdm_disabled"]) == (1, False, False)


@pytest.mark.parametrize("mode", ["fail", "debug_fail"])
def test_failed_rank_stops_the_others_and_raises(mode, tmp_path):
    """...and leaves nothing in the caller's temp dir: torch.multiprocessing's error file of each failed child
    (pytorch-errorfile-*.pickle) stayed there before, one per failed rank per attempt; the ranks themselves see
    the caller's temp dir."""
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    log = _run(mode, tmp_path, timeout=120, TMPDIR=str(tmpdir))  # rank 0 sleeps 600 s unless the launcher stops it
    assert os.listdir(tmpdir) == [], os.listdir(tmpdir)
    assert [open(tmp_path / f"tempdir_r{r}").read() for r in range(2)] == [str(tmpdir)] * 2
    with open(tmp_path / "caught.json") as fh:
        caught = json.load(fh)
    expected = "ChildFailedError" if mode == "fail" else "ProcessRaisedException"
    assert caught["type"] == expected, (caught, log[-3000:])
    assert "ValueError: boom on rank 1" in caught["message"], caught["message"]
    if mode == "fail":  # the root cause named is the rank that raised, not the peer its exit broke
        root = caught["message"].split("Root Cause", 1)[1]
        assert "rank      : 1 (local_rank: 1)" in root and "boom on rank 1" in root, caught["message"]
    pids = [int(open(tmp_path / f"pid_r{r}").read()) for r in range(2)]
    assert not any(alive(p) for p in pids), f"ranks left running: {[p for p in pids if alive(p)]}"



def _argument_errors(mod_name: str) -> list:
    """(type, message) of each notebook_launcher misuse HF rejects before launching anything."""
    mod = importlib.import_module(mod_name)
    got = []
    for kwargs in ({}, {"num_processes": 2, "node_rank": 1, "num_nodes": 1}):
        try:
            mod.notebook_launcher(print, **kwargs)
        except Exception as e:  # noqa: BLE001 - compared below
            got.append((type(e).__name__, str(e)))
    reset_state(mod_name)
    mod.Accelerator(cpu=True)
    try:
        mod.notebook_launcher(print, num_processes=2)
    except Exception as e:  # noqa: BLE001
        got.append((type(e).__name__, str(e)))
    finally:
        reset_state(mod_name)
    return got


def test_argument_errors_match_hf(monkeypatch):
    for key in [k for k in os.environ if k.startswith(("KAGGLE", "ACCELERATE_"))]:
        monkeypatch.delenv(key)
    ours, hf = _argument_errors("accelerate_c"), _argument_errors("accelerate")
    assert len(hf) == 3 and all(t == "ValueError" for t, _ in hf), hf
    assert ours == hf


def test_unknown_mixed_precision_is_a_clear_error():
    from accelerate_c import notebook_launcher

    with pytest.raises(ValueError, match="Unknown mixed_precision mode: fp4"):
        notebook_launcher(print, num_processes=2, mixed_precision="fp4")
