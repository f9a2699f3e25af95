# tests/test_pipeline_schedules.py: the pipeline schedules (accelerate_c/pipeline/schedules.py) through the one
# simulator (simulator.py): the bubble of GPipe and 1F1B is (p-1)/(m+p-1) for equal stages, interleaved 1F1B's
# (p-1)/(v·m+p-1), ZB-H1's at most half of 1F1B's; stage 0 holds p micro-batches under 1F1B and m under GPipe; the
# simulator rejects broken schedules (a missing action, a dependency out of order, a deadlock, a channel whose two
# ends disagree on the order); the chart (render.py); the sizes' errors.
# Not for: running schedules on processes (test_pipeline_parity.py).
import pytest

from accelerate_c.pipeline.render import ascii_chart, chart
from accelerate_c.pipeline.schedules import (F, RECV_F, SEND_F, Action, Schedule, build_schedule, check_sizes,
                                             forward_only)
from accelerate_c.pipeline.simulator import ScheduleError, simulate

EQUAL = {"F": 1.0, "B": 1.0, "W": 1.0}  # a full backward lasts B + W = 2F


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p,m", [(2, 2), (2, 4), (2, 8), (4, 4), (4, 8), (3, 5)])
def test_bubble_gpipe_1f1b(name, p, m):
    res = simulate(build_schedule(name, p, m), EQUAL)
    assert res.bubble == pytest.approx((p - 1) / (m + p - 1), abs=1e-12)
    assert res.busy == [3.0 * m] * p


@pytest.mark.parametrize("p,m,v", [(2, 2, 2), (2, 4, 2), (2, 8, 3), (4, 4, 2), (4, 8, 2), (4, 8, 3)])
def test_bubble_interleaved(p, m, v):
    res = simulate(build_schedule("interleaved_1f1b", p, m, v), {k: t / v for k, t in EQUAL.items()})
    assert res.bubble == pytest.approx((p - 1) / (v * m + p - 1), abs=1e-12)


@pytest.mark.parametrize("p,m", [(2, 2), (2, 4), (2, 8), (4, 4), (4, 8), (4, 16)])
def test_zero_bubble_h1(p, m):
    zb = simulate(build_schedule("zb_h1", p, m), EQUAL)
    one = simulate(build_schedule("1f1b", p, m), EQUAL)
    assert zb.bubble == pytest.approx((p - 1) / (3 * m + p - 1), abs=1e-12)  # ZB-H1: (p-1)(F+B-W) idle per rank
    assert zb.bubble <= 0.5 * one.bubble
    assert max(zb.peak_inflight.values()) == p  # no rank holds more than 1F1B's stage 0
    # B slower than W (a transformer's backward): each rank idles (p-1)(F+B-W), against 1F1B's (p-1)(F+B+W)
    times = {"F": 1.0, "B": 1.2, "W": 0.8}
    if m >= p:
        assert simulate(build_schedule("zb_h1", p, m), times).makespan == pytest.approx(3 * m + (p - 1) * 1.4)


@pytest.mark.parametrize("p,m", [(2, 4), (2, 8), (4, 8)])
def test_peak_inflight(p, m):
    assert simulate(build_schedule("1f1b", p, m), EQUAL).peak_inflight[0] == p
    assert simulate(build_schedule("gpipe", p, m), EQUAL).peak_inflight[0] == m
    assert simulate(build_schedule("1f1b", p, m), EQUAL).peak_inflight[p - 1] == 1


def test_comm_time_and_forward_only():
    gp = simulate(build_schedule("gpipe", 2, 2), EQUAL, comm=0.5)
    assert gp.makespan == pytest.approx(9 + 2 * 0.5)  # (m+p-1)(F+B) plus one message each way on the critical path
    fw = simulate(forward_only(2, 4), EQUAL)
    assert fw.makespan == 5.0 and fw.peak_inflight == {0: 4, 1: 4}
    assert simulate(forward_only(2, 4, 2), EQUAL).makespan == 9.0


def _prog(*rows, m=1):
    return Schedule("test", len(rows), 1, m, tuple(tuple(r) for r in rows))


def test_validation_errors():
    ok = build_schedule("1f1b", 2, 1)
    simulate(ok, EQUAL)
    missing = _prog(ok.actions[0][:-1], ok.actions[1])  # rank 0 lost its B
    with pytest.raises(ScheduleError, match="no B of micro-batch 0 on stage 0"):
        simulate(missing, EQUAL)
    early = _prog([Action(F, 0, 0), Action(SEND_F, 0, 0), *ok.actions[0][2:]], [ok.actions[1][1], ok.actions[1][0],
                                                                                 *ok.actions[1][2:]])
    with pytest.raises(ScheduleError, match=r"rank 1: F0@1 needs RECV_F0@1, which is after it"):
        simulate(early, EQUAL)
    wrong_rank = _prog([*ok.actions[0], Action("W", 0, 1)], ok.actions[1])
    with pytest.raises(ScheduleError, match="belongs to rank 1"):
        simulate(wrong_rank, EQUAL)
    # both ranks wait for the other's gradient first: deadlock
    a = build_schedule("gpipe", 2, 2)
    r1 = list(a.actions[1])
    r1.insert(0, r1.pop(r1.index(Action("SEND_B", 1, 1))))
    with pytest.raises(ScheduleError, match=r"rank 1: SEND_B1@1 needs B1@1, which is after it"):
        simulate(_prog(a.actions[0], r1, m=2), EQUAL)


def test_deadlock_and_order_mismatch():
    s = build_schedule("gpipe", 2, 2)
    r0, r1 = list(s.actions[0]), list(s.actions[1])
    # rank 1 receives micro-batch 1 before micro-batch 0: the channel's two ends disagree on the order
    assert r1[:4] == [Action(RECV_F, 0, 1), Action(F, 0, 1), Action(RECV_F, 1, 1), Action(F, 1, 1)]
    swapped = r1[2:4] + r1[0:2] + r1[4:]
    with pytest.raises(ScheduleError, match="disagree on the order"):
        simulate(_prog(r0, swapped, m=2), EQUAL)
    # rank 0 waits for a gradient before sending the forward that produces it: deadlock, named
    moved = list(r0)
    moved.remove(Action(SEND_F, 1, 0))
    moved.append(Action(SEND_F, 1, 0))
    with pytest.raises(ScheduleError, match=r"deadlocks: rank 0 at RECV_B0@0, rank 1 at RECV_F1@1"):
        simulate(_prog(moved, r1, m=2), EQUAL)


def test_sizes_errors():
    with pytest.raises(ValueError, match="unknown pipeline schedule 'pipedream'"):
        check_sizes("pipedream", 2, 4, 1)
    with pytest.raises(ValueError, match="6 micro-batches, pp_size=4"):
        build_schedule("interleaved_1f1b", 4, 6, 2)
    with pytest.raises(ValueError, match="pp_virtual_stages=2 needs 'interleaved_1f1b'"):
        build_schedule("1f1b", 2, 4, 2)


def test_channels_and_chart(tmp_path):
    s = build_schedule("interleaved_1f1b", 2, 2, 2)
    assert s.channels() == [(0, 1, "B", 2), (0, 1, "F", 0), (0, 1, "F", 2), (1, 0, "B", 1), (1, 0, "B", 3),
                            (1, 0, "F", 1)]
    text = chart(build_schedule("1f1b", 2, 2), EQUAL, path=str(tmp_path / "c.txt"))
    assert text.splitlines() == ["1f1b: p=2 m=2, bubble 33.3%",
                                 "rank 0 |F0F1    B0--  B1--",
                                 "rank 1 |  F0B0--F1B1--"]
    assert (tmp_path / "c.txt").read_text().strip() == text
    inter = ascii_chart(s, simulate(s, EQUAL))
    assert "f0" in inter and "b1" in inter  # odd chunks in lower case
