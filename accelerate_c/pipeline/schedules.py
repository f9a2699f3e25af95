# accelerate_c/pipeline/schedules.py: pipeline schedules as lists of actions, one list per pipeline rank: GPipe,
# 1F1B (the default), interleaved 1F1B (v virtual stages per rank) and ZB-H1 (zero bubble: the backward split into
# the input gradient B and the weight gradient W, the W's filling the bubble). Every consumer (the simulator, the
# runtime, the pictures, the benchmark) reads the same Schedule object.
# Placement: stage s (of S = p·v) lives on rank s % p as virtual chunk s // p (Megatron's looping placement); with
# v = 1 stage s is rank s. An action is (op, micro-batch, stage): F, B, W compute; SEND_F / RECV_F carry stage s's
# output activation to stage s+1 (named by the sending stage on the send, the receiving stage on the receive);
# SEND_B / RECV_B carry the gradient of stage s's input back to stage s-1 (same naming). A B is the full backward
# (input and weight gradients) unless the schedule also has a W for that micro-batch and stage: then B is the input
# gradient only. Sends are asynchronous (they never block the rank), receives block until the message arrived; each
# directed stage edge is a FIFO channel, so a stage's F's (and B's) run in micro-batch order.
# Not for: timing or validation (simulator.py), executing actions (runtime.py).
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

F, B, W = "F", "B", "W"
SEND_F, RECV_F, SEND_B, RECV_B = "SEND_F", "RECV_F", "SEND_B", "RECV_B"
COMPUTE = (F, B, W)
NAMES = ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1")


class Action(NamedTuple):
    op: str
    mb: int
    stage: int

    def __repr__(self) -> str:
        return f"{self.op}{self.mb}@{self.stage}"


@dataclass(frozen=True)
class Schedule:
    """A pipeline schedule: `actions[r]` is rank r's program. p ranks, v virtual stages per rank, m micro-batches."""

    name: str
    p: int
    v: int
    m: int
    actions: tuple

    @property
    def num_stages(self) -> int:
        return self.p * self.v

    def rank_of(self, stage: int) -> int:
        return stage % self.p

    def stages_of(self, rank: int) -> list:
        return [c * self.p + rank for c in range(self.v)]

    def split_backward(self) -> bool:
        """True when some backward is split into B (input gradient) and W (weight gradient)."""
        return any(a.op == W for acts in self.actions for a in acts)

    def channels(self) -> list:
        """The directed cross-rank channels the schedule uses, as (src rank, dst rank, kind, sending stage), sorted:
        every rank computes the same list from the schedule alone."""
        out = set()
        for r, acts in enumerate(self.actions):
            for a in acts:
                if a.op == SEND_F:
                    out.add((r, self.rank_of(a.stage + 1), "F", a.stage))
                elif a.op == SEND_B:
                    out.add((r, self.rank_of(a.stage - 1), "B", a.stage))
        return sorted(out)


def check_sizes(name: str, p: int, m: int, v: int) -> None:
    """The numbers a schedule needs, each error naming them."""
    if name not in NAMES:
        raise ValueError(f"unknown pipeline schedule {name!r}; choose one of {', '.join(NAMES)}")
    if p < 1 or m < 1 or v < 1:
        raise ValueError(f"pipeline sizes must be >= 1: pp_size={p}, num_micro_batches={m}, virtual stages={v}")
    if v != 1 and name != "interleaved_1f1b":
        raise ValueError(f"schedule {name!r} runs one stage per rank; pp_virtual_stages={v} needs "
                         "'interleaved_1f1b'")
    if name == "interleaved_1f1b" and m % p:
        raise ValueError(f"interleaved_1f1b needs num_micro_batches divisible by pp_size: {m} micro-batches, "
                         f"pp_size={p}")


def _gpipe(p: int, m: int, r: int) -> list:
    return [Action(F, i, r) for i in range(m)] + [Action(B, i, r) for i in range(m)]


def _one_f_one_b(p: int, m: int, r: int) -> list:
    warm = min(p - 1 - r, m)
    out = [Action(F, i, r) for i in range(warm)]
    for i in range(m - warm):
        out += [Action(F, warm + i, r), Action(B, i, r)]
    return out + [Action(B, i, r) for i in range(m - warm, m)]


def _interleaved(p: int, m: int, v: int, r: int) -> list:
    """Megatron's interleaved 1F1B: virtual micro-batch k runs chunk (k mod p·v) // p (reversed for backward) on
    micro-batch (k // p·v)·p + k mod p; rank r warms up with 2(p-1-r) + (v-1)p forwards."""
    total = m * v

    def at(k: int, backward: bool) -> tuple:
        chunk = (k % (p * v)) // p
        if backward:
            chunk = v - 1 - chunk
        return (k // (p * v)) * p + k % p, chunk * p + r

    warm = min(2 * (p - 1 - r) + (v - 1) * p, total)
    out = [Action(F, *at(k, False)) for k in range(warm)]
    for i in range(total - warm):
        out += [Action(F, *at(warm + i, False)), Action(B, *at(i, True))]
    return out + [Action(B, *at(k, True)) for k in range(total - warm, total)]


def _zb_h1(p: int, m: int, r: int) -> list:
    """ZB-H1: 1F1B's order of F and B (B = the input gradient) with each weight gradient W delayed: rank r runs W(i)
    after B(i + r), and its last r + 1 W's at the end. The downstream ranks' B's then reach the upstream ranks
    sooner and the W's fill the waits: with equal F, B and W times the bubble is (p-1)/(3m+p-1), a third of 1F1B's,
    and every rank holds at most p micro-batches between F and W (1F1B's stage 0)."""
    out, pending = [], []
    for a in _one_f_one_b(p, m, r):
        out.append(a)
        if a.op == B:
            pending.append(a.mb)
            if len(pending) > r:
                out.append(Action(W, pending.pop(0), r))
    return out + [Action(W, i, r) for i in pending]


def _with_comm(orders: list, p: int, v: int) -> tuple:
    """Inserts the receives right before the compute that needs them and the sends right after the compute that
    produced them (cross-rank edges only; an edge inside one rank passes the tensor directly)."""
    last = p * v - 1
    out = []
    for acts in orders:
        prog: list = []
        for a in acts:
            s, i = a.stage, a.mb
            if a.op == F and s > 0 and (s - 1) % p != s % p:
                prog.append(Action(RECV_F, i, s))
            if a.op == B and s < last and (s + 1) % p != s % p:
                prog.append(Action(RECV_B, i, s))
            prog.append(a)
            if a.op == F and s < last and (s + 1) % p != s % p:
                prog.append(Action(SEND_F, i, s))
            if a.op == B and s > 0 and (s - 1) % p != s % p:
                prog.append(Action(SEND_B, i, s))
        out.append(tuple(prog))
    return tuple(out)


def build_schedule(name: str, p: int, m: int, v: int = 1) -> Schedule:
    """The schedule `name` for p ranks, m micro-batches and v virtual stages per rank (interleaved only)."""
    check_sizes(name, p, m, v)
    if name == "gpipe":
        orders = [_gpipe(p, m, r) for r in range(p)]
    elif name == "1f1b":
        orders = [_one_f_one_b(p, m, r) for r in range(p)]
    elif name == "interleaved_1f1b":
        orders = [_interleaved(p, m, v, r) for r in range(p)]
    else:
        orders = [_zb_h1(p, m, r) for r in range(p)]
    return Schedule(name, p, v, m, _with_comm(orders, p, v))


def forward_only(p: int, m: int, v: int = 1) -> Schedule:
    """Eval: each of a rank's stages runs its F's in micro-batch order, stage after stage; no backward."""
    orders = [[Action(F, i, s) for s in range(r, p * v, p) for i in range(m)] for r in range(p)]
    return Schedule("forward", p, v, m, _with_comm(orders, p, v))
