# tests/test_example_finetune.py: examples/finetune_transformers.py with small settings on 2 processes: a GPT-2
# built from a config, bf16, gradient accumulation, clipping, a warmup schedule, TensorBoard, checkpoints.
# The same script under HF Accelerate 1.15 (torchrun) and accelerate_c (our launcher) gives the same per-step
# losses (1e-5 on the same bf16 kernels; 1e-3 with our CPU bf16 kernels, the default where the CPU lacks native bf16); ours interrupted after a checkpoint and resumed gives the uninterrupted run's losses; the TensorBoard
# event file holds the logged losses.
# Not for: the demo job (train_gpt.py, `make demo`).
import json
import os
import subprocess
import sys

from conftest import ROOT, clean_env, free_port

SCRIPT = os.path.join(ROOT, "examples", "finetune_transformers.py")
SMALL = ["--max_steps", "6", "--checkpoint_every", "3", "--n_layer", "2", "--n_embd", "64", "--block_size", "64",
         "--batch_size", "4", "--dropout", "0", "--corpus_bytes", "200000", "--warmup_steps", "2"]


def _launch(tmp_path, name, args, hf=False, **extra):
    env = clean_env(**extra)
    if hf:
        env["ACCELERATE_USE_CPU"] = "1"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
               SCRIPT, "--impl", "accelerate", *args]
    else:
        cmd = [sys.executable, "-m", "accelerate_c", "launch", "--num_processes", "2", SCRIPT, *args]
    log = tmp_path / f"{name}.log"
    with open(log, "w") as fh:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=fh, stderr=subprocess.STDOUT, timeout=600)
    return proc.returncode, log.read_text()


def _losses(out):
    with open(os.path.join(out, "losses.json")) as f:
        return json.load(f)


def _ok(rc, text, out=None, hf=False):
    if rc == 0:
        return
    # HF 1.15's own teardown race (destroy_process_group while a peer finishes its last gloo op) can abort a rank
    # after every result is written: that is the baseline's bug, not under test, and only tolerated then.
    complete = out is not None and os.path.exists(os.path.join(out, "losses.json")) and len(_losses(out)) == 6
    assert hf and complete and ("terminate called" in text or "SIGABRT" in text), f"run failed ({rc}):\n{text[-6000:]}"


def test_finetune_example_matches_hf_and_resumes_exactly(tmp_path):
    ours, same_kernels, hf, resumed = (str(tmp_path / n) for n in ("ours", "same_kernels", "hf", "resumed"))
    rc, text = _launch(tmp_path, "ours", SMALL + ["--output_dir", ours])
    _ok(rc, text)
    # the library against HF's at 1e-5: our run on torch's own bf16 kernels, as HF's (on a CPU without native bf16
    # matmuls ours default to precision/cpu_bf16.py's, whose fp32 sums run in another order: a bf16-level tolerance)
    rc, text = _launch(tmp_path, "same_kernels", SMALL + ["--output_dir", same_kernels],
                       ACCELERATE_C_CPU_BF16_MATMUL="torch")
    _ok(rc, text)
    rc, text = _launch(tmp_path, "hf", SMALL + ["--output_dir", hf], hf=True)
    _ok(rc, text, hf, hf=True)
    la, ls, lb = _losses(ours), _losses(same_kernels), _losses(hf)
    assert len(la) == len(ls) == len(lb) == 6
    for i, (x, y, z) in enumerate(zip(ls, lb, la)):
        assert abs(x - y) <= 1e-5 * abs(y), f"step {i + 1}: accelerate_c {x} vs HF {y}"
        assert abs(z - y) <= 1e-3 * abs(y), f"step {i + 1}: accelerate_c (default kernels) {z} vs HF {y}"

    rc, text = _launch(tmp_path, "first", SMALL + ["--output_dir", resumed, "--stop_after", "3"])
    _ok(rc, text)
    assert sorted(d for d in os.listdir(resumed) if d.startswith("step_")) == ["step_3"]
    rc, text = _launch(tmp_path, "second", SMALL + ["--output_dir", resumed, "--resume_from_checkpoint", "latest"])
    _ok(rc, text)
    assert "resumed from" in text and "step 3" in text, text[-3000:]
    assert _losses(resumed) == la  # bit for bit: the interrupted-and-resumed run is the uninterrupted one

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    runs = [os.path.join(dp, "") for dp, _, files in os.walk(os.path.join(ours, "finetune"))
            if any(f.startswith("events.out.tfevents") for f in files)]
    assert runs, os.listdir(ours)
    ea = EventAccumulator(runs[0])
    ea.Reload()
    logged = [(e.step, e.value) for e in ea.Scalars("train_loss")]
    assert [s for s, _ in logged] == list(range(1, 7))
    assert all(abs(v - x) <= 1e-6 * abs(x) for (_, v), x in zip(logged, la))
