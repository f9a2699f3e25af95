# tests/test_checkpoint_agree.py: a 2-process load_state that one rank cannot complete ends with every rank raising
# the same CheckpointError and nothing loaded on any rank (tests/scripts/load_agree.py), under plain DDP and under
# ZeRO-3 (the case of a piece file deleted, where a script that catches the error used to go on with a model mixed
# from the checkpoint and its fresh values). One launch per strategy covers every case. The intact checkpoint then
# restores rank 0 exactly (before, the balanced writer layout could save rank 1's BatchNorm statistics). A save given
# a different directory on each rank stops every rank with an error naming it and leaves nothing (before, rank 1 died
# alone on a SafetensorError and rank 0 waited at the next barrier).
import json
import os
import sys

import pytest

from conftest import Job, clean_env, describe_all, finish_all

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts", "load_agree.py")


@pytest.mark.parametrize("flags", [[], ["--use_deepspeed", "--zero_stage", "3"]], ids=["ddp", "zero3"])
def test_every_rank_raises_the_same_error_and_keeps_its_state(tmp_path, flags):
    out = tmp_path / "out"
    out.mkdir()
    cmd = [sys.executable, "-m", "accelerate_c", "launch", "--num_processes", "2", "--main_process_port", "0",
           *flags, SCRIPT, "--out", str(out)]
    job = Job(cmd, str(tmp_path), "agree", clean_env())
    (rc, _, _), = finish_all([job], 300)
    files = [out / f"agree{r}.json" for r in range(2)]
    assert rc == 0 and all(p.exists() for p in files), describe_all([job])
    runs = [json.loads(p.read_text()) for p in files]
    for case, pattern in (("piece_deleted", "model-rank00001-of-00002.safetensors is missing"),
                          ("rng_of_rank1", "rank 1: .*random_states_1.json holds no valid RNG state")):
        errors = [run["cases"][case]["error"] for run in runs]
        assert errors[0] is not None and errors[0] == errors[1], (case, errors, describe_all([job]))
        assert errors[0].startswith("CheckpointError") and pattern.split(".*")[-1] in errors[0], (case, errors)
        assert all(run["cases"][case]["unchanged"] for run in runs), (case, runs)
    assert runs[1]["cases"]["rng_of_rank1"]["error"].count("rank 1") >= 1
    for run in runs:
        assert run["per_rank_save"]["left"] == [] and "not the directory the main process is writing" in \
            (run["per_rank_save"]["error"] or ""), run["per_rank_save"]
    # the intact checkpoint restores rank 0 exactly; rank 1 gets rank 0's BatchNorm statistics (replicas' buffers
    # drift apart; rank 0's are saved, as DDP broadcasts them before the next forward and HF saves them)
    assert runs[0]["restored"], runs[0]
    assert set(runs[1]["differs"]) <= {"1.running_mean", "1.running_var"}, runs[1]
