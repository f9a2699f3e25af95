# Cross-machine failure notice for multi-machine launches. torch's static rendezvous has no way to tell
# the other machines' agents that one machine's rank failed, so their ranks would sit in a collective
# until its timeout (30 min). Each launcher watches one key in the rendezvous TCPStore on the main
# machine; the launcher whose rank failed writes its one-line reason there, and every other launcher
# then stops its own ranks (by sending itself SIGTERM, which torch's agent turns into a clean shutdown).
# Not for: failures inside one machine (the elastic agent handles those) or restarts.
from __future__ import annotations

import datetime
import os
import signal
import threading
import time
from typing import Any


class FailureWatch:
    """Start with start(); post(line) on a local failure; `remote` holds another machine's line."""

    def __init__(self, host: str, port: int, run_id: str, machine_rank: int, num_machines: int,
                 poll_s: float = 0.5) -> None:
        self.host, self.port, self.machine_rank, self.num_machines = host, port, machine_rank, num_machines
        self.key = f"accelerate_c/{run_id}/failed"
        self.ack_key = f"accelerate_c/{run_id}/failed_ack"
        self.poll_s = poll_s
        self.remote: str | None = None
        self._store: Any = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="accelerate_c-failure-watch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _connect(self) -> Any:
        from torch.distributed import TCPStore

        # The main machine's agent creates the server during rendezvous; keep retrying until it is up.
        while not self._stop.is_set():
            try:
                return TCPStore(self.host, self.port, is_master=False, wait_for_workers=False,
                                timeout=datetime.timedelta(seconds=5))
            except Exception:  # noqa: BLE001 - server not up yet
                time.sleep(self.poll_s)
        return None

    def _run(self) -> None:
        store = self._store = self._connect()
        misses = 0
        while store is not None and not self._stop.wait(self.poll_s):
            try:
                if store.check([self.key]):
                    self.remote = store.get(self.key).decode("utf-8", "replace")
                    store.add(self.ack_key, 1)
                    if not self._stop.is_set():
                        os.kill(os.getpid(), signal.SIGTERM)  # the agent stops our ranks and raises
                    return
                misses = 0
            except Exception:  # noqa: BLE001 - the main machine is gone (finished or failed)
                misses += 1
                if misses > 10:
                    return

    def post(self, line: str, wait_s: float = 5.0) -> None:
        """Tell the other machines; wait (bounded) until they have seen it, so the store outlives the read."""
        self.stop()
        try:
            store = self._connect_once()  # own connection: the watch thread may still use its one
            store.set(self.key, f"machine {self.machine_rank}: {line}")
            deadline = time.monotonic() + wait_s
            while store.add(self.ack_key, 0) < self.num_machines - 1 and time.monotonic() < deadline:
                time.sleep(0.1)
        except Exception:  # noqa: BLE001 - best effort: the store may already be gone
            pass

    def _connect_once(self) -> Any:
        from torch.distributed import TCPStore

        return TCPStore(self.host, self.port, is_master=False, wait_for_workers=False,
                        timeout=datetime.timedelta(seconds=2))
