# `python -m accelerate_c launch`: run a script on N local processes (CPU or GPU) and optionally over
# several machines, on torch's elastic agent (LaunchConfig + elastic_launch), never a home-made spawner.
# Settings come from the config file (--config_file; else, unless --cpu, the default file: ours, then
# HF's), then flags (flags win; HF's spellings, underscores or hyphens); the ranks receive the
# ClusterConfig's ACCELERATE_* variables plus ACCELERATE_C_HOST_ID / ACCELERATE_C_RUN_ID and OMP_NUM_THREADS.
# A failed rank stops every rank and turns into one line naming the rank and its error.
# Not for: config file handling (config_args.py) or anything that runs inside a rank (_bootstrap.py).
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import re
import shutil
import signal
import socket
import sys
import uuid
from typing import Any, Iterator

from ..base import leftovers, settings
from ..base.killpoints import kill_point
from .arrivals import ArrivalWatch
from .config_bounds import check_launch
from .watchdog import FailureWatch, stopped_line
from .config_args import ClusterConfig, ConfigError, find_default_config, load_config, parse_rdzv_conf
from .config_flags import HelpFormatter, add_config_flags, add_flag, apply_flags

BOOTSTRAP = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_bootstrap.py")
DEFAULT_MULTI_MACHINE_PORT = 29500  # HF's default when several machines must agree on a port
SHUTDOWN_TIMEOUT_S = 5  # SIGTERM -> SIGKILL grace for the ranks, so a failure ends the job well within 30 s
# The loggers of torch's launch stack that run in this (the launcher's) process; `-q` silences them.
TORCH_LAUNCH_LOGGERS = ("torch.distributed.elastic", "torch.distributed.launcher", "torch.distributed.run")


def launch_config(**kwargs: Any) -> Any:
    """torch's LaunchConfig with our ranks' shutdown grace where this torch takes one (shutdown_timeout is newer than
    torch 2.11, whose agent waits its own fixed 30 s between SIGTERM and SIGKILL); every other field as given."""
    from torch.distributed.launcher.api import LaunchConfig
    if "shutdown_timeout" in {f.name for f in dataclasses.fields(LaunchConfig)}:
        kwargs["shutdown_timeout"] = SHUTDOWN_TIMEOUT_S
    return LaunchConfig(**kwargs)


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("launch", allow_abbrev=False, help="run a training script on several processes/machines",
                              formatter_class=HelpFormatter,
                              description="Launch a script on --num_processes local processes (CPU or GPU) with "
                                          "torch's elastic agent. Flags may be spelled with hyphens or underscores "
                                          "(--num-processes 2 / --num_processes 2), as in HF Accelerate.")
    add_flag(p, "--config_file", default=None, help="config file (default, unless --cpu is given: the one `config` "
             "wrote, else HF Accelerate's $HF_HOME/accelerate/default_config.yaml, if any)")
    add_config_flags(p)
    add_flag(p, "--host_id", default=None, help="ACCELERATE_C_HOST_ID for these ranks: ranks with the same id "
             "share memory (default: unique per launcher invocation and machine rank)")
    add_flag(p, "--as_accelerate", action="store_true", help="every `import accelerate` in the ranks resolves to "
             "accelerate_c (ACCELERATE_C_AS_ACCELERATE=1): for scripts that use HF Accelerate through transformers' "
             "Trainer, PEFT or TRL, run unchanged")
    add_flag(p, "--module", "-m", action="store_true", help="the target is a module name, as `python -m`")
    add_flag(p, "--no_python", action="store_true", help="run the target as an executable, without python")
    add_flag(p, "--quiet", "-q", action="store_true", help="hide the log lines of torch's elastic agent and launcher "
             "(a failure still ends in one line naming the failed rank)")
    p.add_argument("training_script", help="script (or module with -m) to run")
    p.add_argument("training_script_args", nargs=argparse.REMAINDER, help="arguments of the script")
    p.set_defaults(func=launch_command)
    return p


def launch_command_parser(subparsers: Any = None) -> argparse.ArgumentParser:
    """HF's entry for code that builds the launch parser (TRL's CLI): a sub-parser of `subparsers`, or a parser
    of its own; parse_args gives what launch_command takes."""
    if subparsers is not None:
        return add_parser(subparsers)
    root = argparse.ArgumentParser(prog="accelerate_c", allow_abbrev=False)
    return add_parser(root.add_subparsers(dest="command"))


def resolve_config(args: argparse.Namespace) -> ClusterConfig:
    """Config file + flags. The file: --config_file; else the default file (ours, else HF's) unless --cpu
    was given (HF's rule: `--cpu` launches ignore the default file); else built-in defaults."""
    if args.distributed_type == "MULTI_GPU" and args.use_cpu:
        raise ConfigError("--multi_gpu and --cpu cannot be used together; allowed: one of them")
    if args.distributed_type == "MULTI_GPU" and args.num_processes is not None and args.num_processes < 2:
        raise ConfigError(f"--num_processes {args.num_processes} with --multi_gpu; allowed: 2 or more processes")
    path = args.config_file or (None if args.use_cpu else find_default_config())
    if path:
        cfg = load_config(path)
    else:
        cfg = ClusterConfig()
        if args.num_processes is None and not args.use_cpu:
            cfg = ClusterConfig(num_processes=max(1, _cuda_count()))
    file_ds_fields = list(cfg.deepspeed_config)  # HF's ACCELERATE_CONFIG_DS_FIELDS: the file's keys, not flags
    cfg = apply_flags(cfg, args)
    if not cfg.use_cpu and _cuda_count() == 0:
        if cfg.distributed_type == "MULTI_GPU":
            _warn(f"distributed_type MULTI_GPU (--multi_gpu) but no CUDA GPU is visible; running {cfg.num_processes} "
                  "CPU process(es) instead")
            cfg = dataclasses.replace(cfg, distributed_type="MULTI_CPU" if cfg.num_processes > 1 else "NO")
        cfg = dataclasses.replace(cfg, use_cpu=True)  # no GPU: the ranks are CPU ranks (ACCELERATE_USE_CPU=true)
    cfg.ds_file_fields = file_ds_fields
    if cfg.log_dir and os.path.isfile(cfg.log_dir):
        raise ConfigError(f"config key `log_dir`: {cfg.log_dir!r} is a file; allowed: a directory (created if missing)")
    if cfg.gradient_clipping is not None and cfg.distributed_type != "DEEPSPEED":
        _warn(f"gradient_clipping={cfg.gradient_clipping} is passed to the ranks (ACCELERATE_GRADIENT_CLIPPING) but, "
              "as in HF, only DeepSpeed applies it (distributed_type DEEPSPEED / --use_deepspeed); otherwise call "
              "accelerator.clip_grad_norm_ in the script")
    check_launch(cfg, _cores(), _warn)  # the machine's limits, ACCELERATE_C_*, FSDP/DeepSpeed as the ranks read them
    return cfg


def _warn(text: str) -> None:
    print(f"accelerate_c launch: warning: {text}", file=sys.stderr, flush=True)


def quiet_torch_logs() -> None:
    """`-q`. torch's elastic modules give each of their loggers its own level (LOGLEVEL, else WARNING) when
    imported, so a level set on the parent "torch.distributed.elastic" is ignored by them, and lets the
    ERROR "failed (exitcode ...)" line through anyway; "torch.distributed.launcher" is outside that tree.
    Records still travel up the hierarchy whatever the levels, so each parent gets a NullHandler and stops
    propagation: every record of those trees, from modules imported now or later, ends there."""
    for name in TORCH_LAUNCH_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(h, logging.NullHandler) for h in logger.handlers):
            logger.addHandler(logging.NullHandler())
        logger.propagate = False


def _cuda_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def rank_env(cfg: ClusterConfig, args: argparse.Namespace, nproc: int, run_id: str) -> dict[str, str]:
    """Variables to add to each rank's environment (torch's elastic agent adds RANK, LOCAL_RANK,
    WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT, TORCHELASTIC_*)."""
    env = cfg.env()
    host = re.sub(r"[^A-Za-z0-9_.-]", "_", socket.gethostname())[:40]
    env[settings.var("HOST_ID")] = args.host_id or f"{host}-{uuid.uuid4().hex[:12]}-m{cfg.machine_rank}"
    env[settings.var("RUN_ID")] = run_id
    env[settings.var("NUM_MACHINES")] = str(cfg.num_machines)
    env[settings.var("LAUNCHER_PID")] = str(os.getpid())  # ranks die with the launcher (_bootstrap.py)
    if getattr(args, "as_accelerate", False):
        env[settings.var("AS_ACCELERATE")] = "1"  # the .pth hook and _bootstrap.py turn the switch on in each rank
    if "OMP_NUM_THREADS" not in env and "OMP_NUM_THREADS" not in os.environ:  # HF: flag, else the variable
        env["OMP_NUM_THREADS"] = str(max(1, _cores() // nproc))
    if cfg.gpu_ids and cfg.gpu_ids != "all" and not cfg.use_cpu:
        env["CUDA_VISIBLE_DEVICES"] = cfg.gpu_ids
    return env


@contextlib.contextmanager
def _patched_environ(env: dict[str, str]) -> Iterator[None]:
    # The elastic agent copies os.environ into every rank, so the variables go there for the launch.
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def rendezvous(cfg: ClusterConfig) -> dict[str, Any]:
    """LaunchConfig rendezvous fields. One machine + port 0/None: c10d store on 127.0.0.1:0 (the OS picks
    a free port at bind time, so simultaneous launches never collide). A fixed port or several
    machines: the static rendezvous (TCPStore on the main machine; node rank = machine_rank)."""
    ip, port = cfg.main_process_ip, cfg.main_process_port
    if cfg.num_machines == 1 and not port:
        return dict(rdzv_backend="c10d", rdzv_endpoint=f"{ip or '127.0.0.1'}:0", rdzv_configs={"is_host": True},
                    run_id=uuid.uuid4().hex, local_addr=ip or "127.0.0.1")
    if cfg.num_machines == 1:
        return dict(rdzv_backend="static", rdzv_endpoint=f"{ip or '127.0.0.1'}:{port}", rdzv_configs={"rank": 0},
                    run_id=uuid.uuid4().hex, local_addr=ip or "127.0.0.1")
    if not ip:
        raise ConfigError("config key `main_process_ip`: required when num_machines > 1; allowed: the address "
                          "of the machine with machine_rank 0")
    if port == 0:
        raise ConfigError("config key `main_process_port`: 0 (pick a free port) only works on one machine; "
                          "allowed: a fixed port 1..65535 shared by all machines")
    port = port or DEFAULT_MULTI_MACHINE_PORT
    # Every machine must use the same run id: the static store prefixes its keys with it.
    conf: dict[str, Any] = {"rank": cfg.machine_rank} if cfg.rdzv_backend == "static" else {}
    conf.update(_rdzv_timeout())
    return dict(rdzv_backend=cfg.rdzv_backend, rdzv_endpoint=f"{ip}:{port}", rdzv_configs=conf,
                run_id=f"accelerate_c-{ip}-{port}", local_addr=None)


def _rdzv_timeout() -> dict[str, int]:
    """ACCELERATE_C_RDZV_TIMEOUT (seconds): how long the machines wait for each other at the rendezvous
    (torch's default: 900 for c10d, 600 for static). Tests set it short. A bad value is a ConfigError."""
    try:
        seconds = settings.get("RDZV_TIMEOUT")
    except ValueError as e:
        raise ConfigError(f"{e} (seconds)") from None
    return {} if seconds is None else {"timeout": seconds}


def _entry(args: argparse.Namespace) -> tuple[str, list[str]]:
    if args.no_python:
        if args.module:
            raise ConfigError("--module and --no_python cannot be used together")
        return args.training_script, list(args.training_script_args)
    if not args.module and not os.path.isfile(args.training_script):
        raise FileNotFoundError(f"training script {args.training_script!r} not found (use -m for a module)")
    target = ["-m", args.training_script] if args.module else [args.training_script]
    return sys.executable, [BOOTSTRAP, *target, *args.training_script_args]


def describe_failure(exc: Any, machine_rank: int, nproc: int) -> str:
    """One line naming the first failed rank and its error. SIGTERM is what the agent sends the other
    ranks once one failed, so those come last; then the earliest error file (sub-second mtime; torch's
    own choice uses whole-second timestamps), then the failure time, then the lowest rank."""
    def order(item: tuple[int, Any]) -> tuple[int, float, int]:
        rank, f = item
        stopped_by_agent = int(f.exitcode == -int(signal.SIGTERM))
        path = getattr(f, "error_file", "")
        if path and os.path.isfile(path):
            return (stopped_by_agent, os.stat(path).st_mtime, rank)
        return (stopped_by_agent, float(f.timestamp), rank)

    def how(f: Any) -> str:
        return f"killed by signal {f.signal_name()}" if f.exitcode < 0 else f"exit code {f.exitcode}"

    rank, f = min(exc.failures.items(), key=order)
    msg = f.message if isinstance(f.message, str) else f.message.get("message", "")
    detail = "" if (not msg or msg.startswith("To enable traceback") or msg.startswith("Signal ")) else f": {msg}"
    others = [f"rank {r} {how(o)}" for r, o in sorted(exc.failures.items()) if r != rank]
    tail = f" (then: {'; '.join(others)})" if others else ""
    return (f"accelerate_c launch: rank {rank} (local rank {f.local_rank} on machine {machine_rank}) failed, "
            f"{how(f)}{detail}; all {nproc} local ranks were stopped{tail}")


def launch_command(args: argparse.Namespace) -> int:
    cfg = resolve_config(args)
    if cfg.distributed_type == "XLA":
        raise ConfigError("config key `distributed_type`: XLA is not supported by accelerate_c; allowed: "
                          "any other distributed type")
    nproc = cfg.num_processes // cfg.num_machines
    rdzv = rendezvous(cfg)
    rdzv["rdzv_configs"] = {**rdzv["rdzv_configs"], **parse_rdzv_conf(cfg.rdzv_conf)}  # --rdzv_conf wins
    log_dir = leftovers.make_launch_dir()  # named after this launcher: a later launch or `cleanup` reclaims it
    kill_point("launch.temp_dir")
    watch = None
    if cfg.num_machines > 1:  # first, so that every later failure of this launcher reaches the other machines
        host, port = rdzv["rdzv_endpoint"].rsplit(":", 1)
        watch = FailureWatch(host, int(port), rdzv["run_id"], cfg.machine_rank, cfg.num_machines,
                             grace_s=2 * SHUTDOWN_TIMEOUT_S + 10,
                             on_forced_exit=lambda: shutil.rmtree(log_dir, ignore_errors=True))
        watch.start()
    try:
        return _launch(args, cfg, nproc, rdzv, log_dir, watch)
    except BaseException as exc:  # not a rank's failure: a rendezvous error, a missing script, a bug here
        if watch is not None and watch.remote is None:
            watch.post(f"the launcher failed: {type(exc).__name__}: {exc}")
        raise
    finally:
        if watch is not None:
            watch.stop()
        shutil.rmtree(log_dir, ignore_errors=True)
        leftovers.sweep_segments()  # what killed ranks left in /dev/shm (every rank is gone by now)


def _launch(args: argparse.Namespace, cfg: ClusterConfig, nproc: int, rdzv: dict[str, Any], log_dir: str,
            watch: FailureWatch | None) -> int:
    """Runs the agent; a failed rank or a signal becomes one line on stderr (and the other machines' notice)."""
    entrypoint, argv = _entry(args)
    env = rank_env(cfg, args, nproc, rdzv["run_id"])
    arrivals = ArrivalWatch(os.path.join(log_dir, "arrivals"), nproc, cfg.startup_report_interval, cfg.machine_rank)
    env.update(arrivals.rank_env())

    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException, Std
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    if args.quiet:
        quiet_torch_logs()
    lc = launch_config(min_nodes=cfg.num_machines, max_nodes=cfg.num_machines, nproc_per_node=nproc,
                      logs_specs=DefaultLogsSpecs(log_dir=cfg.log_dir or log_dir, tee=Std.from_str(cfg.tee)),
                      role="accelerate_c", max_restarts=cfg.max_restarts, monitor_interval=cfg.monitor_interval,
                      start_method="spawn", **rdzv)
    agent_env = dict(env)
    if cfg.max_restarts > 0 and rdzv["rdzv_backend"] == "c10d":
        # A restarted group would otherwise reuse the rendezvous' TCPStore, where the previous attempt's
        # process-group keys (peer addresses) are still present: fresh store per attempt instead (rank 0
        # then hosts it, so scripts should call destroy_process_group() before exiting, as torch advises).
        agent_env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    # The agent turns SIGTERM into SignalException only once its ranks start; from here on, so that a stop
    # during the rendezvous (a cross-machine notice, a user's SIGTERM) also ends through the lines below.
    signal.signal(signal.SIGTERM, _raise_signal_exception)
    try:
        with _patched_environ(agent_env), arrivals:
            elastic_launch(lc, entrypoint)(*argv)
        return 0
    except ChildFailedError as exc:
        line = describe_failure(exc, cfg.machine_rank, nproc)
        print(line, file=sys.stderr, flush=True)
        if watch is not None:  # inside this except block the agent's store is still alive
            watch.post(line.removeprefix("accelerate_c launch: "))
        return 1
    except SignalException as exc:
        if watch is not None and watch.remote:
            print(stopped_line(watch.remote), file=sys.stderr, flush=True)
            return 1
        print(f"accelerate_c launch: received {exc.sigval.name}; all ranks were stopped", file=sys.stderr, flush=True)
        if watch is not None:
            watch.post(f"its launcher received {exc.sigval.name}")
        return 128 + int(exc.sigval)


def _raise_signal_exception(signum: int, frame: Any) -> None:
    from torch.distributed.elastic.multiprocessing import SignalException

    raise SignalException(f"Process {os.getpid()} got signal: {signum}", sigval=signal.Signals(signum))
