# Cross-machine failure notice for multi-machine launches. torch's static rendezvous has no way to tell
# the other machines' agents that one machine failed, so their ranks would sit in a collective until its
# timeout (30 min) and a main-machine agent already in torch's exit barrier would wait there 300 s. Each
# launcher watches one key in the rendezvous TCPStore on the main machine; a launcher that fails for any
# reason writes its one-line reason there, and every other launcher then stops its own ranks.
# Not for: failures inside one machine (the elastic agent handles those) or restarts.
#
# Stopping is SIGTERM to our own process, which torch's agent turns into a clean shutdown of its ranks, but
# a Python signal handler only runs when the main thread is back in the interpreter. Two agent states keep
# it inside one blocking TCPStore call: the exit barrier (store.wait, up to 300 s) and the rendezvous (up
# to its timeout). So the watch also releases torch's exit barrier key (the wait returns, the pending
# SIGTERM is raised right after it), and if the launcher still has not stopped after a grace period it ends
# the process itself; its ranks follow through PR_SET_PDEATHSIG (_bootstrap.py).
from __future__ import annotations

import datetime
import os
import signal
import sys
import threading
import time
from typing import Any, Callable, Optional

CONNECT_TIMEOUT_S = 2.0  # one store call of the watch; bounds how long stop() waits for the thread
MAX_MISSES = 3  # consecutive store errors: the main machine's launcher is gone (finished or failed)


class FailureWatch:
    """start(); post(line) on any local failure; stop() before the process exits (joins the thread: a daemon
    thread still inside a TCPStore call while the interpreter exits aborts it with std::terminate).
    `remote` holds another machine's line once one arrived."""

    def __init__(self, host: str, port: int, run_id: str, machine_rank: int, num_machines: int, *,
                 poll_s: float = 0.2, grace_s: float = 20.0, seen_wait_s: float = 30.0,
                 on_forced_exit: Optional[Callable[[], None]] = None) -> None:
        self.host, self.port, self.run_id = host, port, run_id
        self.machine_rank, self.num_machines = machine_rank, num_machines
        self.key = f"accelerate_c/{run_id}/failed"
        self.seen_key = f"accelerate_c/{run_id}/failed_seen"  # launchers that know: posters and readers
        self.poll_s, self.grace_s, self.seen_wait_s = poll_s, grace_s, seen_wait_s
        self.on_forced_exit = on_forced_exit
        self.remote: Optional[str] = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="accelerate_c-failure-watch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, join_s: float = 3 * CONNECT_TIMEOUT_S) -> None:
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(join_s)

    # ---- the watch thread ---------------------------------------------------------------------------------
    def _connect(self) -> Any:
        # The main machine's agent creates the server during rendezvous; keep retrying until it is up.
        while not self._stop.is_set():
            try:
                return _client(self.host, self.port)
            except Exception:  # noqa: BLE001 - server not up yet
                self._stop.wait(self.poll_s)
        return None

    def _run(self) -> None:
        store = self._connect()
        misses = 0
        while store is not None and not self._stop.wait(self.poll_s):
            try:
                if store.check([self.key]):
                    self.remote = store.get(self.key).decode("utf-8", "replace")
                    store.add(self.seen_key, 1)
                    break
                misses = 0
            except Exception:  # noqa: BLE001
                misses += 1
                if misses >= MAX_MISSES:
                    return
        if self.remote is None or self._stop.is_set():
            return
        os.kill(os.getpid(), signal.SIGTERM)  # the agent stops our ranks and raises SignalException
        _release_exit_barrier(store, self.run_id)
        if self._stop.wait(self.grace_s):
            return
        # Still running: the main thread is stuck in a blocking store call (see the header); our ranks are not
        # running in those states, and any that are get SIGTERM from the kernel when we exit.
        print(stopped_line(self.remote), file=sys.stderr, flush=True)
        if self.on_forced_exit is not None:
            self.on_forced_exit()
        os._exit(1)

    # ---- the failing launcher -------------------------------------------------------------------------------
    def post(self, line: str) -> None:
        """Tells the other machines (the first notice wins). The main machine's launcher hosts the store (it
        lives while the caller's exception is being handled), so it waits, bounded, until every launcher knows;
        another machine's launcher that failed early waits, bounded, for that store to come up."""
        self.stop()
        deadline = time.monotonic() + self.seen_wait_s
        store = None
        while store is None:
            try:
                store = _client(self.host, self.port)
            except Exception:  # noqa: BLE001 - not up yet (or gone: then nobody can be told)
                if self.machine_rank == 0 or time.monotonic() >= deadline:
                    return
                time.sleep(self.poll_s)
        try:
            store.compare_set(self.key, "", f"machine {self.machine_rank}: {line}")
            store.add(self.seen_key, 1)
            while (self.machine_rank == 0 and store.add(self.seen_key, 0) < self.num_machines
                   and time.monotonic() < deadline):
                time.sleep(0.1)
        except Exception:  # noqa: BLE001 - best effort: the main machine's store may be gone
            pass


def stopped_line(remote: str) -> str:
    return f"accelerate_c launch: stopped this machine's ranks because {remote}"


def _client(host: str, port: int) -> Any:
    from torch.distributed import TCPStore

    return TCPStore(host, port, is_master=False, wait_for_workers=False,
                    timeout=datetime.timedelta(seconds=CONNECT_TIMEOUT_S))


def _release_exit_barrier(store: Any, run_id: str) -> None:
    """Sets the key torch's exit barrier waits on (the static rendezvous prefixes the agents' keys with the
    run id), so an agent blocked there returns to Python and handles the pending SIGTERM. When torch renames
    its keys this does nothing and the grace period ends the launcher instead."""
    try:
        from torch.distributed import PrefixStore
        from torch.distributed.elastic.agent.server.api import _TERMINAL_STATE_SYNC_ID
        from torch.distributed.elastic.utils.store import _LAST_MEMBER_CHECKIN

        PrefixStore(run_id, store).set(_TERMINAL_STATE_SYNC_ID + _LAST_MEMBER_CHECKIN, "accelerate_c: failed")
    except Exception:  # noqa: BLE001 - best effort
        pass
