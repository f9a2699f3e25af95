# accelerate_c/pipeline/runtime.py: runs one rank's program of a Schedule for one batch (its m micro-batches): F runs
# the stage (under autocast, optionally with saved-tensor accounting), B backpropagates the micro-batch's loss share
# (the last stage) or the received output gradient, W runs the deferred weight gradients, and the SEND/RECV actions
# move activations and gradients over the p2p transport (comm/p2p.py). Sends are asynchronous and waited for at the
# end of the step; receives are posted ahead (two per channel, and a gradient's receive as soon as the activation it
# answers has been sent). Shapes are agreed once per shape: the first activation of a new batch signature (the
# micro-batch's keys, shapes and dtypes, the same on every rank of the pipeline) on a channel is preceded by a small
# meta message (dtype, shape); gradients have the shape of the activation they answer. An edge between two stages of
# one rank passes tensors directly. Any exception aborts the transport (every peer's waits fail naming this rank and
# the error) and waits for this rank's requests in flight to fail (their buffers stay alive until then) before it
# propagates, so no stage is left waiting.
# Measures: per-step timeline of the compute actions (busy time per stage, for the bubble), and with track_memory the
# bytes of activations each stage holds (tensors autograd saves during F, parameters excluded; a micro-batch's bytes
# count until its backward, or its W, finished).
# Not for: building stages (engine.py), schedules (schedules.py).
from __future__ import annotations

import time
from collections import defaultdict, deque
from contextlib import nullcontext
from typing import Any, Callable, Optional

import torch

from .deferred import WeightGrads
from .schedules import B, F, RECV_B, RECV_F, SEND_B, SEND_F, W, Schedule

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.uint8,
          torch.int8, torch.bool, torch.int16]
META_LEN = 16
POST_AHEAD = 2
KIND_F, KIND_B, KIND_META = 0, 1, 2


class _Slot:
    __slots__ = ("inp", "out", "loss", "grad_out", "grad_in", "deferred", "held")

    def __init__(self) -> None:
        self.inp = self.out = self.loss = self.grad_out = self.grad_in = None
        self.deferred: list = []
        self.held: dict = {}


class Runner:
    """One rank's executor. `stage_fn(stage, micro_batch, x)` runs a stage's forward: the hidden state out, or
    (loss share, outputs) on the last stage. `channels` maps (kind "F"/"B", sending stage) to a transport channel."""

    def __init__(self, rank: int, num_stages: int, stage_fn: Callable, transport: Any, channels: dict, *,
                 store: WeightGrads, param_ptrs: set, autocast: Optional[torch.dtype] = None,
                 track_memory: bool = False, device: torch.device = torch.device("cpu")) -> None:
        self.rank, self.S, self.stage_fn = rank, num_stages, stage_fn
        self.transport, self.channels = transport, channels
        self.store, self.param_ptrs, self.autocast, self.track_memory = store, param_ptrs, autocast, track_memory
        self.device = torch.device(device)
        self._meta_seen: dict = defaultdict(dict)   # channel -> {signature: (dtype, shape)}, both ends alike
        self._step = 0
        self.timeline: list = []   # (op, mb, stage, start, end) of the last step, seconds from its start (t0)
        self.t0 = 0.0              # time.perf_counter() at the last step's start (CLOCK_MONOTONIC: one clock per host)
        self.peak_bytes: dict = {}  # stage -> peak activation bytes held in the last step (track_memory)

    # ---- tags and shapes ----------------------------------------------------------------------------------------
    def _tag(self, kind: int, mb: int, stage: int) -> int:
        return ((self._step & 0xFFFFF) << 40) | (kind << 36) | (stage << 16) | mb

    def _local(self, a: int, b: int) -> bool:
        """Stages a and b run on this same rank (rank = stage mod p)."""
        return (a - b) % self._p == 0

    # ---- one step --------------------------------------------------------------------------------------------
    def execute(self, sched: Schedule, mbs: list, sig: Any, train: bool, scale: Callable) -> dict:
        """Runs this rank's actions; returns {micro-batch: (loss share or None, outputs)} of the last stage."""
        self._p, self._sig, self._mbs, self._train, self._scale = sched.p, sig, mbs, train, scale
        self._step += 1
        self._slots: dict = defaultdict(_Slot)
        self._sends: list = []
        self._grad_recv: dict = {}
        self._f_pending: dict = defaultdict(deque)   # channel -> (mb, stage) receives not yet posted
        self._f_posted: dict = defaultdict(deque)    # channel -> (mb, stage, work, buffer)
        self._has_w = {(a.mb, a.stage) for a in sched.actions[self.rank] if a.op == W}
        self.timeline, self.peak_bytes, self._live = [], {}, defaultdict(int)
        self._t0 = self.t0 = time.perf_counter()
        results: dict = {}
        for a in sched.actions[self.rank]:
            if a.op == RECV_F:
                self._f_pending[self.channels[("F", a.stage - 1)]].append((a.mb, a.stage))
        try:
            for ch in list(self._f_pending):
                self._post_f(ch)
            for a in sched.actions[self.rank]:
                self._do(a, results)
            for w in self._sends:
                w.wait()
        except BaseException as e:
            if self.transport is not None:
                self.transport.abort(f"pipeline rank {self.rank} raised {type(e).__name__}: {e}"[:380])
                self._drain()
            raise
        finally:
            self._slots = self._grad_recv = self._f_posted = None
            self._sends = []
        return results

    def _drain(self) -> None:
        """After an abort: waits for every request still in flight (they fail at once) before their buffers are
        dropped, so the transport never copies into or out of freed memory."""
        works = list(self._sends) + [w for w, _ in self._grad_recv.values()]
        works += [w for q in self._f_posted.values() for _, _, w, _ in q]
        for w in works:
            try:
                w.wait()
            except Exception:  # the abort's error, already reported by the caller's exception
                pass

    def _do(self, a: Any, results: dict) -> None:
        slot = self._slots[(a.mb, a.stage)]
        if a.op == F:
            self._forward(a.mb, a.stage, slot, results)
        elif a.op == B:
            self._backward(a.mb, a.stage, slot)
        elif a.op == W:
            t = time.perf_counter()
            WeightGrads.run(slot.deferred)
            self._release(a.stage, slot)
            self._timed(W, a.mb, a.stage, t)
            del self._slots[(a.mb, a.stage)]
        elif a.op == SEND_F:
            self._send_f(a.mb, a.stage, slot)
        elif a.op == RECV_F:
            slot.inp = self._recv_f(a.mb, a.stage)
        elif a.op == RECV_B:
            work, buf = self._grad_recv.pop((a.mb, a.stage))
            work.wait()
            slot.grad_out = buf
        elif a.op == SEND_B:
            g = slot.grad_in if slot.grad_in is not None else torch.zeros_like(slot.inp)
            self._sends.append(self.transport.send(self.channels[("B", a.stage)], g.contiguous(),
                                                   self._tag(KIND_B, a.mb, a.stage)))
            slot.inp = slot.grad_in = None
            if not slot.deferred:
                del self._slots[(a.mb, a.stage)]

    def _timed(self, op: str, mb: int, stage: int, t: float) -> None:
        self.timeline.append((op, mb, stage, t - self._t0, time.perf_counter() - self._t0))

    # ---- compute ---------------------------------------------------------------------------------------------
    def _forward(self, mb: int, s: int, slot: _Slot, results: dict) -> None:
        t = time.perf_counter()
        if s > 0 and self._local(s, s - 1):  # the previous stage ran here: take its output directly
            prev = self._slots[(mb, s - 1)]
            slot.inp = prev.out.detach().requires_grad_(self._train and prev.out.is_floating_point())
            if not self._train:
                del self._slots[(mb, s - 1)]
        amp = (torch.autocast(self.device.type, dtype=self.autocast) if self.autocast is not None else nullcontext())
        hooks = nullcontext()
        if self.track_memory and self._train:
            hooks = torch.autograd.graph.saved_tensors_hooks(lambda x: self._pack(slot, x), lambda x: x)
        with torch.set_grad_enabled(self._train), amp, hooks:
            out = self.stage_fn(s, self._mbs[mb], slot.inp)
        if s == self.S - 1:
            slot.loss, logits = out
            results[mb] = (slot.loss.detach() if slot.loss is not None else None,
                           None if self._train else logits)
            if not self._train:
                del self._slots[(mb, s)]
        else:
            slot.out = out
        if self.track_memory and self._train:
            self._live[s] += sum(slot.held.values())
            self.peak_bytes[s] = max(self.peak_bytes.get(s, 0), self._live[s])
        self._timed(F, mb, s, t)

    def _pack(self, slot: _Slot, x: torch.Tensor) -> torch.Tensor:
        st = x.untyped_storage()
        if st.data_ptr() not in self.param_ptrs:
            slot.held[st.data_ptr()] = st.nbytes()
        return x

    def _release(self, s: int, slot: _Slot) -> None:
        if slot.held:
            self._live[s] -= sum(slot.held.values())
            slot.held = {}

    def _backward(self, mb: int, s: int, slot: _Slot) -> None:
        t = time.perf_counter()
        if s < self.S - 1 and slot.grad_out is None:  # the next stage ran here
            nxt = self._slots.pop((mb, s + 1))
            slot.grad_out = nxt.grad_in if nxt.grad_in is not None else torch.zeros_like(slot.out)
        split = (mb, s) in self._has_w
        self.store.target = slot.deferred if split else None
        try:
            if s == self.S - 1:
                if slot.loss is None:
                    raise ValueError("the pipeline's last stage computed no loss: the batch needs labels (or the "
                                     "engine a loss_fn) to train")
                torch.autograd.backward(self._scale(slot.loss))
            else:
                torch.autograd.backward(slot.out, slot.grad_out)
        finally:
            self.store.target = None
        slot.grad_in = slot.inp.grad if slot.inp is not None else None
        slot.out = slot.loss = slot.grad_out = None
        if not split:
            self._release(s, slot)
        if s > 0 and not self._local(s, s - 1):
            slot.inp = None if slot.grad_in is not None else slot.inp  # SEND_B needs only the gradient
        elif s == 0 and not split:
            del self._slots[(mb, s)]
        self._timed(B, mb, s, t)

    # ---- communication --------------------------------------------------------------------------------------
    def _send_f(self, mb: int, s: int, slot: _Slot) -> None:
        ch = self.channels[("F", s)]
        x = slot.out.detach().contiguous()
        seen = self._meta_seen[ch]
        if self._sig not in seen:
            if not 0 < x.dim() <= META_LEN - 2 or x.dtype not in DTYPES:
                raise ValueError(f"pipeline stage {s} output of shape {tuple(x.shape)} and dtype {x.dtype} cannot "
                                 "cross a stage boundary")
            seen[self._sig] = (x.dtype, tuple(x.shape))
            meta = torch.tensor([DTYPES.index(x.dtype), x.dim(), *x.shape] + [0] * (META_LEN - 2 - x.dim()),
                                dtype=torch.int64, device=self.device)
            self._sends.append(self.transport.send(ch, meta, self._tag(KIND_META, mb, s)))
        self._sends.append(self.transport.send(ch, x, self._tag(KIND_F, mb, s)))
        if self._train:  # the gradient that answers it: post its receive now
            buf = torch.empty_like(x)
            self._grad_recv[(mb, s)] = (self.transport.recv(self.channels[("B", s + 1)], buf,
                                                            self._tag(KIND_B, mb, s + 1)), buf)
        else:
            del self._slots[(mb, s)]

    def _post_f(self, ch: int) -> None:
        pending, posted = self._f_pending[ch], self._f_posted[ch]
        known = self._meta_seen[ch].get(self._sig)
        while pending and len(posted) < POST_AHEAD and known is not None:
            mb, s = pending.popleft()
            buf = torch.empty(known[1], dtype=known[0], device=self.device)
            posted.append((mb, s, self.transport.recv(ch, buf, self._tag(KIND_F, mb, s - 1)), buf))

    def _recv_f(self, mb: int, s: int) -> torch.Tensor:
        ch = self.channels[("F", s - 1)]
        if self._sig not in self._meta_seen[ch]:  # a new signature: its shape comes first
            meta = torch.empty(META_LEN, dtype=torch.int64, device=self.device)
            self.transport.recv(ch, meta, self._tag(KIND_META, mb, s - 1)).wait()
            code, ndim, *dims = meta.tolist()
            self._meta_seen[ch][self._sig] = (DTYPES[code], tuple(dims[:ndim]))
            self._post_f(ch)
        pmb, ps, work, buf = self._f_posted[ch].popleft()
        assert (pmb, ps) == (mb, s), f"posted receive {(pmb, ps)} answers RECV_F{mb}@{s}"
        work.wait()
        self._post_f(ch)
        return buf.requires_grad_(self._train and buf.is_floating_point())
