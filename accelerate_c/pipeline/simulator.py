# accelerate_c/pipeline/simulator.py: the one simulator of pipeline schedules. It validates a Schedule (every
# (micro-batch, stage) has one F and one B on its stage's rank, at most one W after the B, each compute comes after
# what it needs, every send has its receive in the same order on its channel, and the programs cannot deadlock under
# the transport's semantics: asynchronous sends, blocking receives, one FIFO channel per directed stage edge) and runs
# it with per-stage compute times, returning per-rank timelines, the bubble fraction and the peak number of
# micro-batches whose activations a stage holds (F done, backward not finished: B, or W when the backward is split).
# Times: `times` maps "F", "B", "W" to one duration for every stage or a list indexed by stage; B is the input
# gradient and W the weight gradient, so a full backward (a B with no W) lasts B + W. `comm` is the time a message
# takes from its send to its arrival.
# Not for: building schedules (schedules.py), pictures (render.py), executing them (runtime.py).
from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Mapping, Sequence, Union

from .schedules import B, F, RECV_B, RECV_F, SEND_B, SEND_F, W, Action, Schedule

Times = Mapping[str, Union[float, Sequence[float]]]


class ScheduleError(ValueError):
    """A schedule that cannot run: a missing or duplicated action, a broken dependency, a deadlock."""


@dataclass
class SimResult:
    makespan: float
    busy: list                     # per rank: seconds spent computing
    timeline: list                 # per rank: [(start, end, Action)] of compute actions, in order
    peak_inflight: dict = field(default_factory=dict)  # stage -> peak micro-batches held

    @property
    def bubble(self) -> float:
        """1 - busy / (ranks x makespan): the idle share of the pipeline's time."""
        p = len(self.busy)
        return 1.0 - sum(self.busy) / (p * self.makespan) if self.makespan > 0 else 0.0


def _dur(times: Times, op: str, stage: int) -> float:
    t = times.get(op, 0.0)
    return float(t[stage] if isinstance(t, (list, tuple)) else t)


def _channel(sched: Schedule, a: Action) -> tuple:
    """(kind, sending stage) of the edge a send or receive travels on."""
    if a.op == SEND_F:
        return ("F", a.stage)
    if a.op == RECV_F:
        return ("F", a.stage - 1)
    if a.op == SEND_B:
        return ("B", a.stage)
    return ("B", a.stage + 1)


def validate(sched: Schedule) -> None:
    """Static checks (placement, one F and one B each, W after B, local dependencies); raises ScheduleError."""
    S, p, last = sched.num_stages, sched.p, sched.num_stages - 1
    seen: dict = {}
    for r, acts in enumerate(sched.actions):
        for i, a in enumerate(acts):
            if not (0 <= a.stage < S and 0 <= a.mb < sched.m):
                raise ScheduleError(f"rank {r}: {a!r} names a stage or micro-batch outside {S} stages x {sched.m}")
            if sched.rank_of(a.stage) != r:
                raise ScheduleError(f"rank {r}: {a!r} belongs to rank {sched.rank_of(a.stage)}")
            if (a.op, a.mb, a.stage) in seen:
                raise ScheduleError(f"rank {r}: {a!r} appears twice")
            seen[(a.op, a.mb, a.stage)] = (r, i)
    required = (F, B) if any(a.op == B for acts in sched.actions for a in acts) else (F,)  # else forward only
    for s in range(S):
        for mb in range(sched.m):
            for op in required:
                if (op, mb, s) not in seen:
                    raise ScheduleError(f"no {op} of micro-batch {mb} on stage {s} (rank {sched.rank_of(s)})")
    cross_prev = lambda s: s > 0 and (s - 1) % p != s % p  # noqa: E731
    cross_next = lambda s: s < last and (s + 1) % p != s % p  # noqa: E731
    for (op, mb, s), (r, i) in seen.items():
        needs = []
        if op == F:
            needs = [(RECV_F, mb, s)] if cross_prev(s) else ([(F, mb, s - 1)] if s > 0 else [])
        elif op == B:
            needs = [(F, mb, s)] + ([(RECV_B, mb, s)] if cross_next(s) else ([(B, mb, s + 1)] if s < last else []))
        elif op == W:
            needs = [(B, mb, s)]
        elif op == SEND_F:
            needs = [(F, mb, s)] if cross_next(s) else [("no send on a local edge", mb, s)]
        elif op == SEND_B:
            needs = [(B, mb, s)] if cross_prev(s) else [("no send on a local edge", mb, s)]
        for n in needs:
            where = seen.get(n)
            if where is None or where[0] != r or where[1] > i:
                what = "missing" if where is None else "after it" if where[0] == r else f"on rank {where[0]}"
                raise ScheduleError(f"rank {r}: {Action(op, mb, s)!r} needs {Action(*n)!r}, which is {what}")


def _run_rank(sched: Schedule, r: int, st: dict, times: Times, comm: float) -> bool:
    """Advances rank r as far as it can; False when it is blocked on a receive."""
    acts = sched.actions[r]
    while st["pc"][r] < len(acts):
        a = acts[st["pc"][r]]
        t = st["clock"][r]
        if a.op in (SEND_F, SEND_B):
            st["chan"][_channel(sched, a)].append((a.mb, t + comm))
        elif a.op in (RECV_F, RECV_B):
            q = st["chan"][_channel(sched, a)]
            if not q:
                return False
            mb, arrival = q.popleft()
            if mb != a.mb:
                raise ScheduleError(f"rank {r}: {a!r} but the next message on its channel is micro-batch {mb} "
                                    "(sender and receiver disagree on the order)")
            st["clock"][r] = max(t, arrival)
        else:
            d = _dur(times, a.op, a.stage)
            if a.op == B and (W, a.mb, a.stage) not in st["has_w"]:
                d += _dur(times, W, a.stage)  # a full backward
            st["clock"][r] = t + d
            st["busy"][r] += d
            st["timeline"][r].append((t, t + d, a))
        st["pc"][r] += 1
    return True


def simulate(sched: Schedule, times: Times, comm: float = 0.0) -> SimResult:
    """Validates `sched` and runs it with `times`; raises ScheduleError on an invalid schedule or a deadlock."""
    validate(sched)
    p = sched.p
    st = {"pc": [0] * p, "clock": [0.0] * p, "busy": [0.0] * p, "timeline": [[] for _ in range(p)],
          "chan": defaultdict(deque),
          "has_w": {(a.op, a.mb, a.stage) for acts in sched.actions for a in acts if a.op == W}}
    progress = True
    while progress:
        progress = False
        for r in range(p):
            before = st["pc"][r]
            _run_rank(sched, r, st, times, comm)
            progress |= st["pc"][r] != before
    stuck = [r for r in range(p) if st["pc"][r] < len(sched.actions[r])]
    if stuck:
        waits = ", ".join(f"rank {r} at {sched.actions[r][st['pc'][r]]!r}" for r in stuck)
        raise ScheduleError(f"schedule {sched.name!r} deadlocks: {waits} wait for messages nobody sends first")
    left = [k for k, q in st["chan"].items() if q]
    if left:
        raise ScheduleError(f"schedule {sched.name!r}: messages sent but never received on channels {left}")
    res = SimResult(max(st["clock"]) if p else 0.0, st["busy"], st["timeline"])
    res.peak_inflight = peak_inflight(sched, st["has_w"])
    return res


def peak_inflight(sched: Schedule, has_w: set) -> dict:
    """stage -> the most micro-batches whose activations it holds at once, in its rank's program order (F adds one;
    the backward that frees it, B or the W of a split backward, removes one)."""
    out: dict = {}
    for acts in sched.actions:
        held: dict = defaultdict(int)
        for a in acts:
            if a.op == F:
                held[a.stage] += 1
                out[a.stage] = max(out.get(a.stage, 0), held[a.stage])
            elif (a.op == B and (W, a.mb, a.stage) not in has_w) or a.op == W:
                held[a.stage] -= 1
    return out
