# tests/test_hf_trainer.py: transformers' Trainer on accelerate_c through the switch, against the same script under HF
# Accelerate 1.15 (examples/hf_trainer.py: a Llama from a config, gradient accumulation, evaluation, save_steps). One
# process in bf16 (ours on its default kernels): per-step losses within bf16 tolerance of HF's, and
# resume_from_checkpoint from the step-3 checkpoint repeats steps 4-6 exactly. Two processes (ours: `launch
# --as_accelerate`, on torch's bf16 kernels where a mode trains in bf16, as TRL's SFT does by default; HF: torchrun,
# its DDP; losses equal HF's, <= 1e-5; tests/scripts/hf_stack_modes.py): the Trainer with accumulation and evaluation, a PEFT LoRA
# adapter through the Trainer and TRL's SFTTrainer in one launch (the LoRA checkpoint holds the adapter only), and the
# Trainer with fsdp="full_shard" + fsdp_config on our sharded engine (HF runs it as DDP on CPU), whose step-2 checkpoint
# (save_fsdp_model / save_fsdp_optimizer) resumes exactly; and the Trainer with torch_compile=True (backend aot_eager:
# dynamo and AOTAutograd through our prepare, without inductor's C++ build), whose checkpoint keys carry no
# torch.compile prefix.
# Not for: inductor's code generation (torch's), or the step-time target (a benchmark's job).
import json
import os
import shutil
import sys

import pytest

from conftest import ROOT, SCRIPTS, Job, clean_env, finish_all, free_port

EXAMPLE = os.path.join(ROOT, "examples", "hf_trainer.py")
RUN = os.path.join(SCRIPTS, "hf_stack_run.py")
MODES = os.path.join(SCRIPTS, "hf_stack_modes.py")


def _run(cmd: list, tmp_path, name: str, **env: str) -> None:
    job = Job(cmd, str(tmp_path / "logs"), name, clean_env(OMP_NUM_THREADS="1", **env), cwd=str(tmp_path))
    (rc, out, err), = finish_all([job], 600)
    assert rc == 0, f"{name} failed ({rc}):\n{out[-3000:]}\n{err[-6000:]}"


def _losses(folder) -> list:
    with open(os.path.join(folder, "losses.json")) as fh:
        return json.load(fh)


def test_trainer_one_process_bf16_and_exact_resume(tmp_path):
    hf_dir, ours_dir = tmp_path / "hf", tmp_path / "ours"
    _run([sys.executable, RUN, EXAMPLE, "--output_dir", hf_dir, "--bf16"], tmp_path, "hf", ACCELERATE_USE_CPU="1")
    _run([sys.executable, RUN, "--ours", EXAMPLE, "--output_dir", ours_dir, "--bf16"], tmp_path, "ours")
    hf, ours = _losses(hf_dir), _losses(ours_dir)
    assert ours["accelerate"].startswith(os.path.join(ROOT, "accelerate_c")), ours["accelerate"]
    assert [s for s, _ in ours["losses"]] == [s for s, _ in hf["losses"]] == [1, 2, 3, 4, 5, 6]
    for (_, a), (_, b) in zip(ours["losses"], hf["losses"]):
        assert a == pytest.approx(b, rel=2e-2), (ours["losses"], hf["losses"])
    shutil.rmtree(ours_dir / "checkpoint-6")
    _run([sys.executable, RUN, "--ours", EXAMPLE, "--output_dir", ours_dir, "--bf16", "--resume"], tmp_path, "resume")
    assert _losses(ours_dir)["losses"] == ours["losses"][3:], "resume_from_checkpoint did not repeat steps 4-6"


def _two(tmp_path, modes: str) -> tuple:
    hf_dir, ours_dir = tmp_path / "hf", tmp_path / "ours"
    _run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
          MODES, modes, hf_dir], tmp_path, "hf", ACCELERATE_USE_CPU="1")
    # TRL's SFTConfig trains in bf16 by default: our side keeps torch's bf16 kernels so that the losses compare at
    # 1e-5 (precision/cpu_bf16.py's, the default on a CPU without native bf16, sum in another order; they meet HF's
    # at bf16 tolerance in test_trainer_one_process_bf16_and_exact_resume)
    _run([sys.executable, "-m", "accelerate_c", "launch", "-q", "--cpu", "--as_accelerate", "--num_processes", "2",
          "--main_process_port", "0", RUN, "--ours", MODES, modes, ours_dir], tmp_path, "ours",
         ACCELERATE_C_CPU_BF16_MATMUL="torch")
    own = [m for m in modes.split(",") if m != "fsdp_resume"]  # fsdp_resume writes into fsdp/
    return {m: _losses(hf_dir / m) for m in own}, {m: _losses(ours_dir / m) for m in own}


def _same_losses(ours: dict, hf: dict) -> None:
    assert len(ours["losses"]) == len(hf["losses"]) == 4
    for (sa, a), (sb, b) in zip(ours["losses"], hf["losses"]):
        assert sa == sb and abs(a - b) <= 1e-5, (ours["losses"], hf["losses"])


def test_trainer_peft_lora_and_trl_sft_two_processes_equal_hf(tmp_path):
    hf, ours = _two(tmp_path, "trainer,lora,sft")
    for mode in ("trainer", "lora", "sft"):
        _same_losses(ours[mode], hf[mode])
    files = ours["lora"]["files"]
    assert "adapter_model.safetensors" in files and "model.safetensors" not in files, files
    assert files == hf["lora"]["files"]


def test_trainer_fsdp_full_shard_and_compile_two_processes_equal_hf_and_resume_exactly(tmp_path):
    hf, ours = _two(tmp_path, "fsdp,fsdp_resume,compile")
    _same_losses(ours["fsdp"], hf["fsdp"])
    _same_losses(ours["compile"], hf["compile"])
    assert ours["compile"]["graphs"] > 0 and hf["compile"]["graphs"] > 0, "torch_compile=True compiled nothing"
    assert ours["compile"]["keys"] == hf["compile"]["keys"] and "model.norm.weight" in ours["compile"]["keys"]
    assert {"pytorch_model_fsdp_0", "optimizer_0"} <= set(ours["fsdp"]["files"]), ours["fsdp"]["files"]
    # transformers passes adapter_only=True for every model and looks for folders named after the model / optimizer;
    # each process's optimizer state is its shard's: the step-2 checkpoint must repeat steps 3 and 4 exactly
    with open(tmp_path / "ours" / "fsdp" / "resumed.json") as fh:
        assert json.load(fh)["losses"] == ours["fsdp"]["losses"][2:]
