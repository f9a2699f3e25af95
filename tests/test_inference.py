# tests/test_inference.py: prepare_pippy (accelerate_c.inference, HF's accelerate.inference) on 2 CPU processes with
# the models of HF's test_pippy built from configs (tests/scripts/pippy_infer.py): the last process's output (every
# process's with gather_output) equals the unsplit model's, with automatic and given split points and a batch padded
# to the chunk count. Before, `accelerate.inference` did not exist; torch's pipelining alone fails on CPU processes
# for BERT (a non-contiguous mask crosses the cut).
# Not for: pipeline-parallel training (test_pp_accelerator.py).
import os

from conftest import run_script


def test_prepare_pippy_matches_the_unsplit_model(tmp_path):
    run_script("pippy_infer.py", ["--out", str(tmp_path)], nproc=2, launcher="accelerate_c")
    assert sorted(os.listdir(tmp_path)) == ["ok0.txt", "ok1.txt"]
