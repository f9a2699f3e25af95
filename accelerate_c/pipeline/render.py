# accelerate_c/pipeline/render.py: a picture of a simulated schedule's timeline (simulator.SimResult): a PNG through
# matplotlib when it is installed, else (and always as the return value) an ASCII chart, one row per rank. The
# pictures in docs/parallelism.md come from `chart(build_schedule(...), {"F": 1, "B": 1, "W": 1})`.
# ASCII: each unit of time is two columns; a block starts with its op and micro-batch (F3 = forward of micro-batch
# 3; B is the whole backward, or the input gradient when the schedule has W's) and runs on as '-'; a blank is idle.
# Interleaved schedules write odd virtual chunks in lower case (f, b, w).
# Not for: the simulation itself (simulator.py).
from __future__ import annotations

from typing import Optional

from .schedules import Schedule
from .simulator import SimResult, Times, simulate

_DIGITS = "0123456789abcdefghijklmnopqrstuvwxyz"


def _label(sched: Schedule, op: str, mb: int, stage: int) -> str:
    letter = op.lower() if (stage // sched.p) % 2 else op
    return letter + (_DIGITS[mb] if mb < len(_DIGITS) else "+")


def ascii_chart(sched: Schedule, res: SimResult) -> str:
    """The timeline as text: a title line, then one row per rank."""
    durations = [e - s for row in res.timeline for s, e, _ in row if e > s]
    unit = min(durations) if durations else 1.0
    cols = int(round(res.makespan / unit * 2))
    title = (f"{sched.name}: p={sched.p}" + (f" v={sched.v}" if sched.v > 1 else "") +
             f" m={sched.m}, bubble {100 * res.bubble:.1f}%")
    lines = [title]
    for r, row in enumerate(res.timeline):
        cells = [" "] * cols
        for s, e, a in row:
            lo, hi = int(round(s / unit * 2)), int(round(e / unit * 2))
            text = _label(sched, a.op, a.mb, a.stage).ljust(max(hi - lo, 1), "-")
            for k in range(lo, min(hi, cols)):
                cells[k] = text[k - lo]
        lines.append(f"rank {r} |{''.join(cells).rstrip()}")
    return "\n".join(lines)


def _png(sched: Schedule, res: SimResult, path: str) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    colors = {"F": "#4c78a8", "B": "#f58518", "W": "#54a24b"}
    fig, ax = plt.subplots(figsize=(max(6.0, res.makespan * 0.35), 0.5 * sched.p + 1))
    for r, row in enumerate(res.timeline):
        for s, e, a in row:
            ax.broken_barh([(s, e - s)], (sched.p - 1 - r - 0.4, 0.8), facecolors=colors[a.op], edgecolor="white")
            ax.text((s + e) / 2, sched.p - 1 - r, _label(sched, a.op, a.mb, a.stage), ha="center", va="center",
                    fontsize=7, color="white")
    ax.set_yticks(range(sched.p), [f"rank {sched.p - 1 - r}" for r in range(sched.p)])
    ax.set_xlabel("time")
    ax.set_title(ascii_chart(sched, res).splitlines()[0])
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def chart(sched: Schedule, times: Times, comm: float = 0.0, path: Optional[str] = None) -> str:
    """Simulates `sched` with `times` and returns the ASCII chart; with `path` (a .png) also draws it there through
    matplotlib, or writes the ASCII chart there (as text) when matplotlib is not installed."""
    res = simulate(sched, times, comm)
    text = ascii_chart(sched, res)
    if path is not None and not (path.endswith(".png") and _png(sched, res, path)):
        with open(path, "w") as fh:
            fh.write(text + "\n")
    return text
