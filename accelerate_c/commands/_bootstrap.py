# Run inside every rank: executes the user's script (or `-m module`) as __main__ and, when it raises,
# writes torch elastic's error file (TORCHELASTIC_ERROR_FILE) so the launcher can name the exception of
# the failed rank. Run as a plain file (`python _bootstrap.py ...`), so it imports nothing of
# accelerate_c or torch itself (base/settings.py, which reads the launcher's variables, is loaded by path
# and dropped). Not for: setting up distributed state (the script/Accelerator does).
#
# With the launcher's ACCELERATE_C_ARRIVAL_DIR it also notes, in that folder, that the rank started and when it
# first calls torch.distributed.init_process_group (a one-shot import hook wraps that function), so the launcher
# can name a rank that keeps the others waiting there (commands/arrivals.py).
#
# With ACCELERATE_C_AS_ACCELERATE (`launch --as_accelerate`) it turns on the switch that serves `import accelerate`
# from accelerate_c before the script runs (the installed .pth hook already did, unless the package runs from a
# checkout on PYTHONPATH): the one case where the bootstrap imports accelerate_c (as_accelerate.py, lazy names).
#
# The rank then leaves without the interpreter's final teardown (see _leave): torch's gloo worker threads
# outlive destroy_process_group (torch keeps the process group referenced once e.g. an optimizer imported
# torch._dynamo), and one that drops a finished collective's tensors while the interpreter finalizes needs
# the GIL, gets pthread_exit from CPython inside a noexcept destructor, and std::terminate aborts the rank
# ("terminate called without an active exception", exit -6) after it finished its work.
import atexit
import gc
import io
import json
import os
import runpy
import sys
import threading
import time
import traceback
import warnings
from typing import Any


def _record(exc: BaseException) -> None:
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path or os.path.exists(path):  # keep a file the script's own @record wrote
        return
    data = {"message": {"message": f"{type(exc).__name__}: {exc}",
                        "extraInfo": {"py_callstack": traceback.format_exc(),
                                      "timestamp": str(int(time.time()))}}}
    try:
        with open(path, "w", encoding="utf-8") as fh:
            json.dump(data, fh)
    except OSError:
        pass


def _settings() -> Any:
    """accelerate_c/base/settings.py, loaded by path and not left in sys.modules: the script must start with
    nothing of accelerate_c imported."""
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "base", "settings.py")
    spec = importlib.util.spec_from_file_location("_accelerate_c_bootstrap_settings", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look the module up while the table is built
    try:
        spec.loader.exec_module(mod)
    finally:
        del sys.modules[spec.name]
    return mod


def _die_with_launcher(settings: Any) -> None:
    # Linux: get SIGTERM when the launcher dies, even by SIGKILL, so no rank is left orphaned.
    launcher = settings.get("LAUNCHER_PID")
    if not sys.platform.startswith("linux") or launcher is None:
        return
    try:
        import ctypes
        import signal

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM), 0, 0, 0)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != launcher:  # it died before prctl took effect
        sys.exit(1)


def _note(path: str, text: str) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.replace(tmp, path)  # the launcher never reads half a note
    except OSError:  # the launcher's folder is gone (it is ending): nobody to tell
        pass


class _InitHook:
    """A sys.meta_path finder that does nothing but, when torch.distributed.distributed_c10d is first imported,
    wrap its init_process_group (before torch.distributed re-exports it) so that the first call notes the
    arrival. It steps aside at once (removed from sys.meta_path) and leaves every other import alone."""
    TARGET = "torch.distributed.distributed_c10d"

    def __init__(self, arrived: Any) -> None:
        self.arrived = arrived

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != self.TARGET:
            return None
        import importlib.util

        if self in sys.meta_path:
            sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)  # the other finders' spec, whose loader gets one extra step
        loader = getattr(spec, "loader", None)
        exec_module = getattr(loader, "exec_module", None)
        if exec_module is None:
            return spec
        arrived = self.arrived

        def exec_and_wrap(module: Any) -> None:
            exec_module(module)
            _wrap_init(module, arrived)

        loader.exec_module = exec_and_wrap
        return spec


def _wrap_init(module: Any, arrived: Any) -> None:
    import functools

    original = getattr(module, "init_process_group", None)
    if not callable(original):
        return
    done = []

    @functools.wraps(original)
    def init_process_group(*args: Any, **kwargs: Any) -> Any:
        if not done:
            done.append(True)
            arrived()
        return original(*args, **kwargs)

    module.init_process_group = init_process_group


def _note_arrivals(settings: Any) -> None:
    """With the launcher's ACCELERATE_C_ARRIVAL_DIR: note `<restart>-<local rank>.started` (rank, group rank, pid)
    now and `.arrived` at the first call of init_process_group (commands/arrivals.py reads them)."""
    folder = settings.get("ARRIVAL_DIR")
    restart, local = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"), os.environ.get("LOCAL_RANK", "")
    if not folder or not restart.isdigit() or not local.isdigit():
        return
    base = os.path.join(folder, f"{restart}-{local}")
    _note(base + ".started", f"rank={os.environ.get('RANK', '')} group_rank={os.environ.get('GROUP_RANK', '')} "
                             f"pid={os.getpid()}")
    arrived = lambda: _note(base + ".arrived", f"pid={os.getpid()}")  # noqa: E731
    c10d = sys.modules.get(_InitHook.TARGET)
    if c10d is not None:  # torch.distributed already imported (a sitecustomize): wrap it where it is
        _wrap_init(c10d, arrived)
        dist = sys.modules.get("torch.distributed")
        if dist is not None:
            dist.init_process_group = c10d.init_process_group
    else:
        sys.meta_path.insert(0, _InitHook(arrived))


def main() -> None:
    settings = _settings()
    _die_with_launcher(settings)
    _note_arrivals(settings)
    if settings.get("AS_ACCELERATE"):
        from accelerate_c.as_accelerate import install_as_accelerate

        install_as_accelerate()
    argv = sys.argv[1:]
    if not argv:
        sys.exit("usage: _bootstrap.py (SCRIPT | -m MODULE) [ARGS...]")
    code: object = 0
    try:
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            sys.path[0] = os.getcwd()  # what `python -m` puts first
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))  # what `python script.py` puts first
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as exc:
        code = exc.code
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # noqa: BLE001 - recorded, printed like python would, exit code 1
        _record(exc)
        tb = exc.__traceback__
        while tb is not None and _is_ours(tb.tb_frame.f_code.co_filename):
            tb = tb.tb_next  # hide this file's and runpy's frames: the user's code comes first
        traceback.print_exception(type(exc), exc, tb)
        del exc, tb
        code = 1
    _leave(code)


def _leave(code: object) -> None:
    """Exits as the interpreter would (SystemExit's code rules, non-daemon threads joined, atexit handlers
    run, open files flushed), then os._exit instead of the interpreter's final teardown (see the header).
    The script's own globals are already freed: runpy ran it in a temporary module."""
    if code is None:
        status = 0
    elif isinstance(code, int):
        status = code & 0xFF
    else:
        print(code, file=sys.stderr)
        status = 1
    shutdown = getattr(threading, "_shutdown", None)  # what Py_Finalize calls first (joins, executor exits)
    if shutdown is not None:
        shutdown()
    atexit._run_exitfuncs()
    gc.collect()
    with warnings.catch_warnings():  # (the isinstance test touches deprecated objects, e.g. dist.reduce_op)
        warnings.simplefilter("ignore")
        for obj in gc.get_objects():
            try:
                if isinstance(obj, io.IOBase) and not obj.closed and obj.writable():
                    obj.flush()
            except Exception:  # noqa: BLE001 - a broken file must not change the rank's exit status
                pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001
            pass
    os._exit(status)


def _is_ours(filename: str) -> bool:
    return filename == __file__ or filename.endswith("runpy.py") or filename == "<frozen runpy>"


if __name__ == "__main__":
    main()
