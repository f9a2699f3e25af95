# tests/test_inference.py: prepare_pippy (accelerate_c.inference, HF's accelerate.inference) on 2 CPU processes with
# the models of HF's test_pippy built from configs (tests/scripts/pippy_infer.py): the last process's output (every
# process's with gather_output) equals the unsplit model's, with automatic and given split points and a batch padded
# to the chunk count. Before, `accelerate.inference` did not exist; torch's pipelining alone fails on CPU processes
# for BERT (a non-contiguous mask crosses the cut).
# Not for: pipeline-parallel training (test_pp_accelerator.py).
import os
import sys

from conftest import SCRIPTS, Job, clean_env, describe_all, finish_all


def test_prepare_pippy_matches_the_unsplit_model(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    cmd = [sys.executable, "-m", "accelerate_c", "launch", "--num_processes", "2", "--main_process_port", "0",
           os.path.join(SCRIPTS, "pippy_infer.py"), "--out", str(out)]
    job = Job(cmd, str(tmp_path), "pippy", clean_env())
    (rc, _, _), = finish_all([job], 300)
    assert rc == 0 and sorted(os.listdir(out)) == ["ok0.txt", "ok1.txt"], describe_all([job])
