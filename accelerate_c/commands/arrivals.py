# The launcher's report of ranks that have not arrived. A rank that hangs before init_process_group (a deadlock,
# a download, a `sleep`) keeps the ranks that did call it waiting there for the process group's timeout, 1800 s
# by default (HF's, kept), with nothing on the console. Each rank notes, in a folder of the launcher's
# (ACCELERATE_C_ARRIVAL_DIR, written by _bootstrap.py), that it started and when it calls init_process_group;
# once the first local rank has called it, the launcher names the local ranks that have not, every
# `startup_report_interval` seconds (60 by default; 0 turns it off), until they all have.
# The view is this machine's: each machine's launcher names its own late ranks, counted from the first of its own
# ranks to arrive. Ranks run without _bootstrap.py (--no_python) note nothing, so nothing is reported for them.
# Not for: failed or dead ranks (the elastic agent stops the group; launch.py names the rank) or the other machines'
# failures (watchdog.py).
from __future__ import annotations

import os
import re
import sys
import threading
import time
from typing import Any, Callable, Optional, TextIO

from ..base import settings

NOTE = re.compile(r"(\d+)-(\d+)\.(started|arrived)")  # <restart count>-<local rank>.<what>, see _bootstrap.py
HF_PG_TIMEOUT_S = 1800  # HF's (and torch's) default process-group timeout, for the message


class ArrivalWatch:
    """`with ArrivalWatch(...):` around the agent's run: a thread that calls tick() and prints its lines.
    tick(now) is the whole logic, callable without the thread (tests drive it with their own clock)."""

    def __init__(self, folder: str, nproc: int, interval_s: float, machine_rank: int, *,
                 out: Optional[TextIO] = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.folder, self.nproc, self.interval_s, self.machine_rank = folder, nproc, interval_s, machine_rank
        self.out, self.clock = out, clock
        self._attempt: Optional[int] = None
        self._first: Optional[tuple[float, list[int]]] = None  # (when, the local ranks seen arrived then)
        self._reports = 0
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        if interval_s > 0:
            os.makedirs(folder, exist_ok=True)

    def rank_env(self) -> dict[str, str]:
        """The variable that tells _bootstrap.py where to note arrivals (nothing when the report is off)."""
        return {settings.var("ARRIVAL_DIR"): self.folder} if self.interval_s > 0 else {}

    # ---- the thread ------------------------------------------------------------------------------------------
    def __enter__(self) -> "ArrivalWatch":
        if self.interval_s > 0:
            self._thread = threading.Thread(target=self._run, name="accelerate_c-arrivals", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)

    def _run(self) -> None:
        poll_s = min(1.0, self.interval_s / 4)
        while not self._stop.wait(poll_s):
            try:
                line = self.tick(self.clock())
            except Exception:  # noqa: BLE001 - a report must never take the launch down
                continue
            if line:
                print(line, file=self.out or sys.stderr, flush=True)

    # ---- the logic -------------------------------------------------------------------------------------------
    def _notes(self) -> dict[int, dict[int, dict[str, str]]]:
        """{restart count: {local rank: {'started': text, 'arrived': text}}} from the folder."""
        notes: dict[int, dict[int, dict[str, str]]] = {}
        try:
            names = os.listdir(self.folder)
        except OSError:
            return notes
        for name in names:
            m = NOTE.fullmatch(name)
            if not m:
                continue
            try:
                with open(os.path.join(self.folder, name), encoding="utf-8") as fh:
                    text = fh.read(200)
            except OSError:
                continue
            notes.setdefault(int(m.group(1)), {}).setdefault(int(m.group(2)), {})[m.group(3)] = text
        return notes

    def tick(self, now: float) -> Optional[str]:
        """The report line due at `now`, or None. The clock starts when the first local rank of the current
        attempt (the highest restart count noted) is seen to have called init_process_group; a line is due at
        every multiple of the interval while some local rank has not."""
        notes = self._notes()
        if not notes:
            return None
        attempt = max(notes)
        if attempt != self._attempt:
            self._attempt, self._first, self._reports = attempt, None, 0
        ranks = notes[attempt]
        arrived = sorted(lr for lr, n in ranks.items() if "arrived" in n and lr < self.nproc)
        if not arrived or len(arrived) >= self.nproc:
            return None
        if self._first is None:
            self._first = (now, arrived)
        waited = now - self._first[0]
        if waited < (self._reports + 1) * self.interval_s:
            return None
        self._reports = int(waited // self.interval_s)
        return self._line(ranks, arrived, waited)

    def _line(self, ranks: dict[int, dict[str, str]], arrived: list[int], waited: float) -> str:
        info = {lr: _started(n.get("started", "")) for lr, n in ranks.items()}
        group = next((i["group_rank"] for i in info.values() if i.get("group_rank") is not None), None)

        def rank_of(lr: int) -> Optional[int]:
            i = info.get(lr) or {}
            if i.get("rank") is not None:
                return i["rank"]
            return None if group is None else group * self.nproc + lr  # torch's numbering: group x local size

        def name(lr: int) -> str:
            r = rank_of(lr)
            return f"rank {r}" if r is not None else f"local rank {lr}"

        def detail(lr: int) -> str:
            if "started" not in ranks.get(lr, {}):
                return f"{name(lr)}: local rank {lr}, not started yet"
            pid = (info.get(lr) or {}).get("pid")
            return f"{name(lr)}: local rank {lr}" + (f", pid {pid}" if pid else "")

        missing = [lr for lr in range(self.nproc) if lr not in arrived]
        first = self._first[1] if self._first else arrived
        one = len(missing) == 1
        return (f"accelerate_c launch: {', '.join(name(lr) for lr in missing)} {'has' if one else 'have'} not called "
                f"init_process_group {waited:.0f} s after {', '.join(name(lr) for lr in first)} did "
                f"(machine {self.machine_rank}; {'; '.join(detail(lr) for lr in missing)}); "
                f"{', '.join(name(lr) for lr in arrived)} {'waits' if len(arrived) == 1 else 'wait'} there, up to the "
                f"process group's timeout ({HF_PG_TIMEOUT_S} s by default); repeated every {self.interval_s:g} s "
                "(--startup_report_interval)")


def _started(text: str) -> dict[str, Optional[int]]:
    """'rank=1 group_rank=0 pid=4242' (what _bootstrap.py writes) -> {'rank': 1, 'group_rank': 0, 'pid': 4242}."""
    out: dict[str, Optional[int]] = {}
    for item in text.split():
        key, _, value = item.partition("=")
        out[key] = int(value) if value.isdigit() else None
    return out
