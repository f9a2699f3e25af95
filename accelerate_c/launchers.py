# accelerate_c/launchers.py: HF's `notebook_launcher` and `debug_launcher`: run a plain Python function on N
# forked processes of this machine (a notebook cell, a test). Each rank gets the environment torch.distributed
# needs, so an Accelerator created inside the function takes accelerate_c's normal multi-process path (gloo +
# shared memory). notebook_launcher runs on torch's elastic agent (as `accelerate_c launch` and HF do): a rank
# that fails stops the others and the caller gets torch's ChildFailedError naming it; debug_launcher uses
# torch.multiprocessing on CPU with a file rendezvous, as HF does.
# Not for: launching scripts (commands/launch.py) or anything that runs inside a rank beyond its set-up.
from __future__ import annotations

import contextlib
import glob
import os
import shutil
import signal
import sys
import tempfile
from typing import Any, Callable, Optional

import torch

from .runtime.state import AcceleratorState, GradientState, PartialState
from .base.dataclasses import PrecisionType
from .base import leftovers
from .base.environment import are_libraries_initialized, patch_environment

# Signals torch's elastic agent takes over in the caller while it runs; the ranks (forked from the caller)
# get the caller's own handlers back, so SIGTERM from the agent ends a rank even while it waits in C.
_SIGNALS = tuple(getattr(signal, n) for n in ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT") if hasattr(signal, n))


def _die_with_parent() -> None:
    """Linux: SIGKILL this rank when the process that forked it dies, so no rank outlives its launcher."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # it died before prctl took effect
        os._exit(1)


@contextlib.contextmanager
def _error_files_in(folder: str) -> Any:
    """torch.multiprocessing names each child's error file (written when the child raises) in the caller's temp
    dir and never removes it: a launch whose ranks fail, or restart, left files in /tmp (HF's too). While the
    processes start, the caller's temp dir is the launch folder (removed after the launch); the ranks get the
    caller's back (_Rank). Yields the caller's setting."""
    saved = tempfile.tempdir
    tempfile.tempdir = folder
    try:
        yield saved
    finally:
        tempfile.tempdir = saved


class _Rank:
    """The entry point each forked rank runs: undo what it inherited from the caller, then the function."""

    def __init__(self, function: Callable, handlers: dict, debug_store: bool = False,
                 tempdir: Optional[str] = None) -> None:
        self.function, self.handlers, self.debug_store, self.tempdir = function, handlers, debug_store, tempdir
        # torch elastic names the job and its events after these
        self.__name__ = getattr(function, "__name__", type(function).__name__)
        self.__qualname__ = getattr(function, "__qualname__", self.__name__)

    def __call__(self, *args: Any) -> Any:
        for sig, handler in self.handlers.items():
            signal.signal(sig, handler)
        tempfile.tempdir = self.tempdir  # the caller's temp dir, not the launch folder the error files go to
        _die_with_parent()
        # The caller may hold single-process state (a logger's PartialState; debug_launcher does not refuse an
        # Accelerator in the caller, as HF); a rank starts afresh.
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
        if self.debug_store:  # torch.multiprocessing passes the local index first
            index, args = args[0], args[1:]
            _init_debug_group(index)
        return self.function(*args)


def _init_debug_group(index: int) -> None:
    os.environ["RANK"] = os.environ["LOCAL_RANK"] = str(index)
    world = int(os.environ["WORLD_SIZE"])
    store = torch.distributed.FileStore(os.environ["ACCELERATE_DEBUG_RDV_FILE"], world)
    torch.distributed.init_process_group("gloo", rank=index, world_size=world, store=store)


def _flush_std() -> None:
    # Forked ranks inherit unflushed stdio buffers and would print the caller's pending output again.
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, ValueError, OSError):
            pass


def _caller_handlers() -> dict:
    return {sig: signal.getsignal(sig) for sig in _SIGNALS if signal.getsignal(sig) is not None}


def _check_precision(mixed_precision: Any) -> str:
    try:
        return PrecisionType(str(getattr(mixed_precision, "value", mixed_precision)).lower()).value
    except ValueError:
        raise ValueError(f"Unknown mixed_precision mode: {str(mixed_precision).lower()}. Choose between "
                         f"{PrecisionType.list()}.") from None


def _check_fresh_parent() -> None:
    if len(AcceleratorState._shared_state) > 0:
        raise ValueError("To launch a multi-device training from your notebook, the `Accelerator` should only be "
                         "initialized inside your training function. Restart your notebook and make sure no cells "
                         "initializes an `Accelerator`.")
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        raise RuntimeError("notebook_launcher: this process already belongs to a torch.distributed process group; "
                           "call it from a plain (non-distributed) process")
    problematic = are_libraries_initialized("bitsandbytes")
    if problematic:
        raise RuntimeError("Could not start distributed process. Libraries known to initialize device upon import "
                           "have been imported already. Please keep these imports inside your training function to "
                           "try and help with this:" + "".join(f"\n\t* `{name}`" for name in problematic))
    if torch.cuda.is_initialized():
        raise RuntimeError("CUDA has been initialized before the `notebook_launcher` could create a forked "
                           "subprocess. Make sure no cell uses the GPU (moves a tensor or model to it, queries "
                           "devices) before calling `notebook_launcher()`, then restart the notebook.")


def _in_notebook_host() -> tuple[bool, bool]:
    in_kaggle = any(key.startswith("KAGGLE") for key in os.environ)
    ipython = sys.modules.get("IPython")
    in_colab = (not in_kaggle and ipython is not None and hasattr(ipython, "get_ipython")
                and "google.colab" in str(ipython.get_ipython()))
    return in_colab, in_kaggle


def _launch_in_process(function: Callable, args: tuple, mixed_precision: str) -> None:
    print("Launching training on one GPU." if torch.cuda.is_available() else "Launching training on CPU.")
    with patch_environment(accelerate_mixed_precision=mixed_precision):
        function(*args)


def notebook_launcher(function: Callable, args: tuple = (), num_processes: Optional[int] = None,
                      mixed_precision: str = "no", use_port: str = "29500", master_addr: str = "127.0.0.1",
                      node_rank: int = 0, num_nodes: int = 1, rdzv_backend: str = "static", rdzv_endpoint: str = "",
                      rdzv_conf: Optional[dict] = None, rdzv_id: str = "none", max_restarts: int = 0,
                      monitor_interval: float = 0.1, log_line_prefix_template: Optional[str] = None) -> None:
    """Runs `function(*args)` on `num_processes` forked processes of this machine (times `num_nodes` machines
    running the same call with their `node_rank`), or in this process when num_processes is 1. The function
    must create its own Accelerator; none may exist in the caller. A failed rank stops the others and raises
    torch's ChildFailedError here (its message holds the rank's traceback)."""
    in_colab, in_kaggle = _in_notebook_host()
    mixed_precision = _check_precision(mixed_precision)
    on_tpu = os.environ.get("TPU_NAME") is not None or os.environ.get("PJRT_DEVICE", "") == "TPU"
    if (in_colab or in_kaggle) and on_tpu:
        raise NotImplementedError("accelerate_c does not support TPU (XLA) training; use a CPU or GPU runtime")
    if in_colab and (not torch.cuda.is_available() or torch.cuda.device_count() < 2):
        _launch_in_process(function, args, mixed_precision)
        return
    if num_processes is None:
        raise ValueError("You have to specify the number of devices you would like to use, add "
                         "`num_processes=...` to your call.")
    if node_rank >= num_nodes:
        raise ValueError("The node_rank must be less than the number of nodes.")
    if num_processes <= 1:
        _launch_in_process(function, args, mixed_precision)
        return
    _check_fresh_parent()

    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.launcher.api import elastic_launch

    from .commands.launch import launch_config

    rdzv_conf = dict(rdzv_conf or {})
    if rdzv_backend == "static":
        rdzv_conf["rank"] = node_rank
        rdzv_endpoint = rdzv_endpoint or f"{master_addr}:{use_port}"
    handlers = _caller_handlers()
    log_dir = leftovers.make_launch_dir()  # named after this process: a SIGKILL's folder is reclaimed later
    config = launch_config(min_nodes=num_nodes, max_nodes=num_nodes, nproc_per_node=num_processes, run_id=rdzv_id,
                           rdzv_endpoint=rdzv_endpoint, rdzv_backend=rdzv_backend, rdzv_configs=rdzv_conf,
                           max_restarts=max_restarts, monitor_interval=monitor_interval, start_method="fork",
                           log_line_prefix_template=log_line_prefix_template,
                           logs_specs=DefaultLogsSpecs(log_dir=log_dir))
    env = dict(nproc=num_processes, node_rank=node_rank, world_size=num_nodes * num_processes,
               master_addr=master_addr, master_port=use_port, accelerate_mixed_precision=mixed_precision,
               fork_launched=1, torchelastic_signals_to_handle=",".join(s.name for s in _SIGNALS))
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    try:
        with patch_environment(**env), _error_files_in(log_dir) as caller_tmp:
            if os.environ.get("ACCELERATE_DEBUG_MODE", "false").lower() == "true":
                _verify_environment(config, handlers, caller_tmp)
            print(f"Launching training on {num_processes} processes.")
            _flush_std()
            elastic_launch(config=config, entrypoint=_Rank(function, handlers, tempdir=caller_tmp))(*args)
    except ChildFailedError as exc:
        raise _with_root_cause(exc, log_dir, node_rank, num_processes) from None
    finally:
        for sig, handler in handlers.items():  # the agent leaves its own handlers installed
            signal.signal(sig, handler)
        shutil.rmtree(log_dir, ignore_errors=True)


def _with_root_cause(exc: Any, log_dir: str, node_rank: int, nproc: int) -> Any:
    """torch's agent reports the first rank it *saw* dead, often a peer that only failed because the real
    culprit's exit broke a collective. Rebuild the error with every rank's error file of the last attempt,
    earliest written first, so its "Root Cause" is the rank that failed first."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    found: dict[int, tuple[float, int, str]] = {}
    for path in glob.glob(os.path.join(log_dir, "*", "attempt_*", "*", "error.json")):
        attempt, local = path.split(os.sep)[-3:-1]
        found[(int(attempt.split("_")[1]), int(local))] = os.stat(path).st_mtime, int(local), path
    if not found:
        return exc
    last = max(attempt for attempt, _ in found)
    files = sorted(v for (attempt, _), v in found.items() if attempt == last)
    known = dict(exc.failures)
    failures = {}
    for _mtime, local, path in files:
        rank = node_rank * nproc + local
        failures[rank] = known.pop(rank, None) or ProcessFailure(local_rank=local, pid=-1, exitcode=1, error_file=path)
    failures.update(known)
    return ChildFailedError(exc.name, failures)


def _verify_environment(config: Any, handlers: dict, tempdir: Optional[str]) -> None:
    """ACCELERATE_DEBUG_MODE: a dry run where each rank only builds its PartialState (HF's check)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    try:
        _flush_std()
        elastic_launch(config=config, entrypoint=_Rank(_test_launch, handlers, tempdir=tempdir))()
    except ChildFailedError as e:
        raise RuntimeError("An issue was found when verifying a stable environment for the notebook launcher. "
                           f"The following error was raised: {e}") from e


def _test_launch() -> None:
    PartialState().destroy_process_group()


def debug_launcher(function: Callable, args: tuple = (), num_processes: int = 2) -> None:
    """Runs `function(*args)` on `num_processes` forked CPU processes joined by a gloo process group over a
    file rendezvous (for debugging and tests, as HF's). A failed rank stops the others and raises
    torch.multiprocessing's ProcessRaisedException (or ProcessExitedException) here."""
    from torch.multiprocessing import start_processes

    rdv_dir = leftovers.make_launch_dir()
    try:
        # gloo's default interface choice (by hostname) is unreliable on CI machines: pin it to loopback.
        with patch_environment(world_size=num_processes, local_world_size=num_processes, master_addr="127.0.0.1",
                               master_port="29500", accelerate_mixed_precision="no", accelerate_use_cpu="yes",
                               accelerate_debug_rdv_file=os.path.join(rdv_dir, "rdv"), gloo_socket_ifname="lo",
                               fork_launched=1), _error_files_in(rdv_dir) as caller_tmp:
            _flush_std()
            start_processes(_Rank(function, _caller_handlers(), debug_store=True, tempdir=caller_tmp), args=args,
                            nprocs=num_processes, start_method="fork")
    finally:
        shutil.rmtree(rdv_dir, ignore_errors=True)
