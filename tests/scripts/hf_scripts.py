# tests/scripts/hf_scripts.py: runs HF Accelerate 1.15's own distributed test scripts (shipped in its wheel:
# accelerate/test_utils/scripts/test_script.py, test_sync.py, test_ops.py, test_distributed_data_loop.py,
# test_ddp_comm_hook.py, test_merge_weights.py, test_notebook.py) on accelerate_c, unchanged but for the departures
# `_adapt` names (one of them removes a race of HF's test_notebook that hangs HF's own run too): every runtime
# name those scripts and HF's test helpers use (Accelerator, AcceleratorState, gather, DistributedType, ...) is
# replaced, in HF's modules, by accelerate_c's object of the same name; HF's test helpers themselves
# (RegressionModel, RegressionDataset, are_the_same_tensors, assert_exception) stay HF's. Launch it as a user would:
#   python -m accelerate_c launch --num_processes 2 [--use_fsdp ... | --use_deepspeed ...] hf_scripts.py test_script
# (test_notebook is run as HF runs it, in one plain process: ACCELERATE_NUM_PROCESSES=2 python hf_scripts.py
# test_notebook; its notebook_launcher starts the processes)
# Prints "HF_SCRIPT_OK <name>" on every rank when the script's main() (or its __main__ block) returned.
# Not for: HF's GPU-only checks (the scripts skip those themselves on CPU).
from __future__ import annotations

import contextlib
import importlib
import os
import runpy
import sys
import tempfile
import types
from typing import Any

SCRIPTS = ("test_script", "test_sync", "test_ops", "test_distributed_data_loop", "test_ddp_comm_hook",
           "test_merge_weights", "test_notebook")


def _ours(hf_module: str, name: str) -> Any:
    """accelerate_c's object for HF's `name` defined in `hf_module` (the same module path, else the package's top
    levels); None when accelerate_c has no such name."""
    tail = hf_module[len("accelerate"):]
    for mod in (f"accelerate_c{tail}", "accelerate_c", "accelerate_c.utils", "accelerate_c.state"):
        try:
            m = importlib.import_module(mod)
        except ImportError:
            continue
        try:
            return getattr(m, name)
        except AttributeError:
            continue
    return None


def patch(script: str) -> tuple[types.ModuleType, list[str]]:
    """Imports HF's script and replaces, in every loaded `accelerate` module, each name that HF defines outside its
    test helpers by accelerate_c's object of that name. Returns the script module and the names of the script's
    own namespace that stay HF's (there must be none but the test helpers)."""
    mod = importlib.import_module(f"accelerate.test_utils.scripts.{script}")
    missing = []
    for modname, m in list(sys.modules.items()):
        if not (modname == "accelerate" or modname.startswith("accelerate.")) or m is None:
            continue
        for name, obj in list(vars(m).items()):
            home = getattr(obj, "__module__", None)
            if name.startswith("__") or not isinstance(home, str) or not home.startswith("accelerate"):
                continue
            if home.startswith("accelerate.test_utils") or home.startswith("accelerate_c"):
                continue  # HF's test helpers stay HF's; already ours
            ours = _ours(home, name)
            if ours is None:
                if m is mod and callable(obj):  # (an object the script built, e.g. test_merge_weights' parser, is
                    missing.append(f"{home}.{name}")  # rebuilt from our names when its __main__ block runs)
                continue
            setattr(m, name, ours)
    return mod, missing


class _SharedTempfile:
    """HF's save_state check gives each rank its own TemporaryDirectory; ours writes one checkpoint every rank
    shares (docs/differences.md), so the directory is rank 0's, made known to all."""

    @staticmethod
    @contextlib.contextmanager
    def TemporaryDirectory() -> Any:
        from accelerate_c.state import PartialState
        from accelerate_c.utils import broadcast_object_list
        with tempfile.TemporaryDirectory() as mine:
            path = broadcast_object_list([mine])[0]
            try:
                yield path
            finally:
                PartialState().wait_for_everyone()


def _cpu_reference_ddp() -> Any:
    """test_ddp_comm_hook builds its reference with torch DDP's GPU arguments (device_ids=[local rank]); on CPU
    processes torch DDP takes none. The script sees torch with that one constructor adapted."""
    import torch

    def ddp(module: Any, device_ids: Any = None, output_device: Any = None, **kw: Any) -> Any:
        on_cpu = all(p.device.type == "cpu" for p in module.parameters())
        return torch.nn.parallel.DistributedDataParallel(module, **kw) if on_cpu else \
            torch.nn.parallel.DistributedDataParallel(module, device_ids, output_device, **kw)
    nn = types.SimpleNamespace(**{**vars(torch.nn), "parallel": types.SimpleNamespace(DistributedDataParallel=ddp)})
    return types.SimpleNamespace(**{**{k: getattr(torch, k) for k in dir(torch) if not k.startswith("__")}, "nn": nn})


def _tough_nut(queue: Any, failures: int = 3) -> None:
    """test_notebook's fault-tolerance check without its race: every attempt before the `failures`-th restart
    raises on both processes (elastic's restart count, not a shared queue, decides), the last one prints the state."""
    from accelerate_c.state import PartialState
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) < failures:
        raise RuntimeError("The nut hasn't cracked yet! Try again.")
    print(f"PartialState:\n{PartialState()}")


def _adapt(script: str, mod: types.ModuleType) -> None:
    """The named departures from HF's scripts as shipped (each says why; docs/differences.md)."""
    if script == "test_script" and os.environ.get("ACCELERATE_USE_FSDP", "").lower() == "true":
        # training_check's bf16/fp16 runs expect fp32 weights to 1e-6: what HF gets on CPU, where it runs FSDP as plain
        # DDP under autocast (a*x+b stays fp32); HF's FSDP engine computes with 16-bit parameters
        # (MixedPrecisionPolicy(param_dtype=...)), and so does ours (docs/differences.md). Those two runs are skipped.
        mod.is_bf16_available = mod.is_fp16_available = lambda *a, **k: False
    if script == "test_distributed_data_loop":
        # it checks that HF's join warns and does nothing under FSDP/DeepSpeed; ours joins there (differences.md)
        mod.test_join_raises_warning_for_non_ddp_distributed = lambda accelerator: None
        mod.tempfile = _SharedTempfile()
    if script == "test_ddp_comm_hook":
        mod.torch = _cpu_reference_ddp()
    if script == "test_notebook":
        # HF's tough_nut_function shares one queue of trials between the processes: when one of them takes the last
        # trial (and waits for its peer in the process group's set-up) while the other finds the queue empty and
        # returns, the job never ends. HF's own run of the script hangs there too (2 of 3 runs on one host). The
        # same check (max_restarts=3: three failed attempts restarted, the fourth succeeds), decided per attempt.
        mod.tough_nut_function = _tough_nut


def run(script: str, marks: str, last: bool) -> None:
    mod, missing = patch(script)
    if missing:
        raise SystemExit(f"hf_scripts.py: names of {script} accelerate_c lacks: {missing}")
    _adapt(script, mod)
    from accelerate_c.state import AcceleratorState, GradientState, PartialState
    destroy = (PartialState.destroy_process_group, AcceleratorState.destroy_process_group)
    if not last:  # the scripts end by destroying the process group: only the last one here does
        PartialState.destroy_process_group = AcceleratorState.destroy_process_group = lambda self, group=None: None
    try:
        if hasattr(mod, "main"):
            mod.main()
        else:  # test_merge_weights: its checks are its `if __name__ == "__main__":` block (names patched above)
            runpy.run_path(mod.__file__, run_name="__main__")
    finally:
        PartialState.destroy_process_group, AcceleratorState.destroy_process_group = destroy
    AcceleratorState._reset_state()  # the next script starts from a fresh Accelerator state (same processes)
    GradientState._reset_state()
    if marks:
        with open(os.path.join(marks, f"{script}.{os.environ.get('RANK', '0')}"), "w") as f:
            f.write("ok\n")
    print(f"HF_SCRIPT_OK {script} rank {os.environ.get('RANK', '0')}", flush=True)


def main() -> None:
    """hf_scripts.py [--marks DIR] SCRIPT...: the scripts one after the other in this process (DIR gets a file
    SCRIPT.RANK for each that passed)."""
    args = sys.argv[1:]
    marks = ""
    if args[:1] == ["--marks"]:
        marks, args = args[1], args[2:]
    for script in args:
        if script not in SCRIPTS:
            raise SystemExit(f"hf_scripts.py: unknown script {script!r}; one of {SCRIPTS}")
    sys.argv = sys.argv[:1]
    for k, script in enumerate(args):
        run(script, marks, last=k == len(args) - 1)


if __name__ == "__main__":
    main()
