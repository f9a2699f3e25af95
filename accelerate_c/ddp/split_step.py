# accelerate_c/ddp/split_step.py: the optimizer step of data parallelism split between the ranks
# of one host (ZeRO-1 inside DDP, invisible to the user). Every rank keeps its own full copy of the
# parameters, as in torch DDP, and its slice of the optimizer state, in shared-memory regions (each rank
# its own part, at the same offset; the pages of a part outside the rank's slice are never written by the
# step, so they take no memory). Gradients are already averaged and identical on every rank, so
# instead of N ranks repeating the same update, rank r updates only its slice [lo_r, hi_r) of the flat
# parameter space (params and state) and then writes its updated params into every peer's part:
#     barrier A (nobody still reads params) -> step own slice -> push own param slice to peers -> barrier B
# Each rank's state is current only in its own slice; optimizer.state_dict() (a torch pre-hook) first
# copies the peers' slices from their parts (no collective: peers only write state between A and B), and
# the next split step gives those pages back (ShmGroup.discard).
# The update is elementwise, so results are bitwise those of the unsplit step.
# Only while gradients, params and state are identical on every rank: the first step after a backward
# under no_sync (per-rank gradients, e.g. local SGD) turns the split off for good.
# Part of the step of strategies/ddp_bucketed.py, which owns one SplitStep per prepared optimizer and
# hands it to the kernels as their partition (optim._fused.run_groups calls begin / slice_lists / end).
# Not for: gradient communication (ddp/bucketed.py) or the kernels (optim/).
from __future__ import annotations

from typing import Any, Optional

import torch

from ..base.dtypes import NAMES

# an optimizer state layout (optim/lowbit.py) -> the dtype of its elements
_LAYOUT_DTYPES = {k: NAMES[k] for k in ("8bit", "bfloat16")}

ALIGN = 16  # elements: slice lengths are rounded to whole 64-byte lines of fp32


class SharedParams:
    """The model's fp32 CPU parameters moved into one shared region (per-rank parts, same offsets).
    `shm` is the host-local ShmGroup, of 2 or more ranks."""

    def __init__(self, params: list[torch.nn.Parameter], shm: Any, grad_sync: Any) -> None:
        self.shm = shm
        self.grad_sync = grad_sync  # .in_sync: the last backward averaged the gradients over all ranks
        self.rank, self.size = shm.rank, shm.size
        mine = [p for p in params if p.dtype == torch.float32 and p.device.type == "cpu" and p.is_contiguous()]
        self.total = sum(p.numel() for p in mine)
        self.flat = shm.alloc(max(self.total, 1), torch.float32)
        self.parts = shm.parts(self.flat)
        self.offset: dict[int, int] = {}
        self._ptr: dict[int, int] = {}
        off = 0
        with torch.no_grad():
            for p in mine:
                n = p.numel()
                view = self.flat[off:off + n].view_as(p)
                view.copy_(p)
                p.data = view
                self.offset[id(p)] = off
                self._ptr[id(p)] = view.data_ptr()
                off += n
        self.mirror_rank = (self.rank + 1) % self.size  # the peer the kernels write directly

    def resident(self, p: torch.Tensor) -> bool:
        """True while p's data is still its slot in the region (replacing p.data after prepare takes it out:
        then every rank steps it whole)."""
        ptr = self._ptr.get(id(p))
        return ptr is not None and p.data_ptr() == ptr

    def push(self, stepped: list[tuple[torch.Tensor, int, int]]) -> None:
        """Copies the slices this rank updated ((param, a, b) element ranges) into every peer's part but the
        one the kernels already wrote (mirror_rank; so with 2 ranks there is nothing left to copy). Only
        those: a parameter stepped whole is stepped by every rank in its own part, and a write into a peer's
        part while the peer still reads that parameter would update it twice."""
        mine = self.parts[self.rank]
        for p, a, b in stepped:
            if b <= a:
                continue
            off = self.offset[id(p)]
            for q, part in enumerate(self.parts):
                if q != self.rank and q != self.mirror_rank:  # the kernel wrote mirror_rank's copy already
                    part[off + a:off + b].copy_(mine[off + a:off + b])


class SplitStep:
    """One optimizer's state in shared regions (per-rank parts, one slot per state key and param), and the
    step protocol. Owned by the bucketed strategy (one per prepared optimizer); the fused kernels use it as
    their partition.
    Low-precision state (optim/lowbit.py) has a slot per key in its own dtype (uint8 codes, bf16, fp32 block
    scales: one region per dtype); an 8-bit param's cuts between ranks fall on its 256-element blocks, so each
    rank requantises whole blocks of its own slice and its scales are its own."""

    def __init__(self, optimizer: torch.optim.Optimizer, shards: SharedParams, keys: tuple[str, ...]) -> None:
        from ..optim import lowbit

        self.shards = shards
        self.keys = keys
        self.disabled = False  # True for good once a step used per-rank gradients
        self.stale = False  # True once a sharded step left other ranks' slices of our state out of date
        # This optimizer's own parameter space (its params in the region, in region order): the split and
        # the state slots cover only them, so an optimizer over a few parameters of a big model (fine-tuning
        # a head) costs state for those few, and its work is still halved.
        group_of = {id(p): g for g in optimizer.param_groups for p in g["params"] if id(p) in shards.offset}
        order = sorted((p for g in optimizer.param_groups for p in g["params"] if id(p) in group_of),
                       key=lambda p: shards.offset[id(p)])
        order = list({id(p): p for p in order}.values())
        self.soff: dict[int, int] = {}
        total = 0
        for p in order:
            self.soff[id(p)] = total
            total += p.numel()
        self.total = total
        per = -(-total // shards.size)
        per = -(-per // ALIGN) * ALIGN
        self.bounds = [(min(q * per, total), min((q + 1) * per, total)) for q in range(shards.size)]
        # every rank's element range inside each param; an 8-bit param's cuts rounded up to its blocks
        self.cuts: dict[int, list[tuple[int, int]]] = {}
        self.slots: dict[tuple[int, int], tuple[torch.dtype, int, int]] = {}  # (key, param) -> dtype, start, n
        need: dict[torch.dtype, int] = {}
        for p in order:
            off, n = self.soff[id(p)], p.numel()
            layout = lowbit.layout_for(group_of[id(p)], p)
            starts = [min(max(lo - off, 0), n) for lo, _ in self.bounds] + [n]
            if layout == "8bit":
                starts = [min(n, -(-x // lowbit.QBLOCK) * lowbit.QBLOCK) for x in starts]
            self.cuts[id(p)] = [(starts[q], max(starts[q], starts[q + 1])) for q in range(shards.size)]
            for k, key in enumerate(keys):
                if key.endswith("_absmax"):
                    if layout != "8bit":
                        continue
                    dt, cnt = torch.float32, lowbit.nblocks(n)
                else:
                    dt, cnt = _LAYOUT_DTYPES.get(layout, torch.float32), n
                self.slots[(k, id(p))] = (dt, need.get(dt, 0), cnt)
                need[dt] = need.get(dt, 0) + cnt
        if not need:
            need[torch.float32] = 0
        self.flats = {dt: shards.shm.alloc(max(cnt, 1), dt) for dt, cnt in sorted(need.items(), key=str)}
        self.parts = {dt: shards.shm.parts(f) for dt, f in self.flats.items()}
        self._hook = optimizer.register_state_dict_pre_hook(lambda opt: self.refresh(opt))
        # id(param) -> (its data_ptr, grad, state tensors, (a, b), sliced views); holding the tensors keeps
        # their ids from being reused while cached, so `is` tells a replaced tensor (e.g. after a reload).
        self._cache: dict = {}
        self._whole = False  # a refresh wrote the peers' slices into our parts (memory the step does not need)
        self._others: Optional[list[torch.Tensor]] = None  # the slices of our parts outside our own ranges

    def local_range(self, p: torch.Tensor) -> Optional[tuple[int, int]]:
        """This rank's element range [a, b) inside `p`, or None when p is not split (not ours, or no longer
        resident in the region)."""
        cuts = self.cuts.get(id(p))
        if cuts is None or not self.shards.resident(p):
            return None
        return cuts[self.shards.rank]

    # -- state placement -----------------------------------------------------------------------------------
    def _slot(self, k: int, p: torch.Tensor, a: int = 0, b: Optional[int] = None, q: Optional[int] = None
              ) -> torch.Tensor:
        """Elements [a, b) (block scales: blocks) of key k's slot for p, in rank q's part (None: ours)."""
        dt, start, n = self.slots[(k, id(p))]
        base = self.flats[dt] if q is None else self.parts[dt][q]
        return base[start + a:start + (n if b is None else b)]

    def _range(self, k: int, a: int, b: int) -> tuple[int, int]:
        """An element range in key k's units (block scales: the blocks covering it; the cuts are on blocks)."""
        if self.keys[k].endswith("_absmax"):
            return a // 256, -(-b // 256)
        return a, b

    def adopt(self, optimizer: torch.optim.Optimizer, p: torch.Tensor) -> bool:
        """Moves p's state tensors into their slots (a fresh state, or one torch's load_state_dict replaced);
        every rank holds the full state at that moment, so each copies its own slice. False when the state holds
        a tensor we have no slot for, or of another dtype (then p is stepped whole on every rank)."""
        state = optimizer.state.get(p)
        if not state:
            return True
        for key, t in state.items():
            if not isinstance(t, torch.Tensor) or key == "step":
                continue
            k = self.keys.index(key) if key in self.keys else -1
            if k < 0 or (k, id(p)) not in self.slots or self.slots[(k, id(p))][0] != t.dtype:
                return False
        a, b = self.cuts[id(p)][self.shards.rank]
        for k, key in enumerate(self.keys):
            t = state.get(key)
            if t is None:
                continue
            slot = self._slot(k, p)
            if t.data_ptr() != slot.data_ptr():
                lo, hi = self._range(k, a, b)
                if hi > lo:  # only our slice: the rest of the slot stays unwritten (no memory), the peers hold it
                    slot[lo:hi].copy_(t.reshape(-1)[lo:hi])
                state[key] = slot.view_as(p) if slot.numel() == p.numel() and not key.endswith("_absmax") else slot
                self.stale = True
        return True

    def slice_lists(self, optimizer: torch.optim.Optimizer, params: list, grads: list, state_lists: dict,
                    lps: Optional[list]) -> tuple[list[tuple[torch.Tensor, int, int]], list, list]:
        """Cuts every kernel-list entry down to this rank's range. `state_lists` maps a state key to its list
        (entries None where that state is absent; block-scale keys are cut to the range's blocks). Returns the
        (param, a, b) ranges cut, the kernels' `mirrors` list (for each cut entry the same range in one peer's
        parameters: the kernel writes the new values there in the same pass; push() covers any other peers)
        and the `offsets` list (a cut entry's first element in its param)."""
        cut: list = []
        mirrors: list = [None] * len(params)
        offsets: list = [0] * len(params)
        cache = self._cache

        def state_tensors(p: torch.Tensor, i: int) -> tuple:
            state = optimizer.state.get(p, {})
            return tuple(state.get(key) if lst is not None and lst[i] is not None else None
                         for key, lst in state_lists.items())

        for i, p in enumerate(params):
            if lps is not None and lps[i] is not None:  # a low-precision copy is written whole: not split
                continue
            g = grads[i]
            sts = state_tensors(p, i)
            hit = cache.get(id(p))
            if (hit is None or hit[0] != p.data_ptr() or hit[1] is not g
                    or any(x is not y for x, y in zip(hit[2], sts))):
                rng = self.local_range(p)
                if rng is None or not self.adopt(optimizer, p):
                    cache.pop(id(p), None)
                    continue
                sts = state_tensors(p, i)  # adopt may have replaced them
                a, b = rng
                off = self.shards.offset[id(p)]
                cuts = []
                for key, t in zip(state_lists, sts):
                    lo, hi = (a // 256, -(-b // 256)) if key.endswith("_absmax") else (a, b)
                    cuts.append(t.view(-1)[lo:hi] if t is not None else None)
                views = (p.detach().view(-1)[a:b], g.view(-1)[a:b], tuple(cuts),
                         self.shards.parts[self.shards.mirror_rank][off + a:off + b])
                hit = (p.data_ptr(), g, sts, (a, b), views)
                cache[id(p)] = hit
            a, b = hit[3]
            params[i], grads[i], svs, mirrors[i] = hit[4]
            offsets[i] = a
            for (key, lst), v in zip(state_lists.items(), svs):
                if v is not None:
                    lst[i] = v
            cut.append((p, a, b))
        return cut, mirrors, offsets

    def refresh(self, optimizer: torch.optim.Optimizer) -> None:
        """Completes this rank's copy of the state with the peers' slices (read from their parts)."""
        if not self.stale:
            return
        for group in optimizer.param_groups:
            for p in group["params"]:
                cuts = self.cuts.get(id(p))
                state = optimizer.state.get(p)
                if cuts is None or not state:
                    continue
                for k, key in enumerate(self.keys):
                    t = state.get(key)
                    if t is None or (k, id(p)) not in self.slots or t.data_ptr() != self._slot(k, p).data_ptr():
                        continue
                    for q, (a, b) in enumerate(cuts):
                        lo, hi = self._range(k, a, b)
                        if q != self.shards.rank and hi > lo:
                            self._slot(k, p, lo, hi).copy_(self._slot(k, p, lo, hi, q))
        self.stale = False
        self._whole = True

    def _discard_peer_slices(self) -> None:
        """The pages of our parts that only hold peers' slices (written by a refresh) back to the system: the split
        step reads and writes only our slice, and the next refresh reads the peers' again."""
        if self._others is None:
            own: dict[torch.dtype, list[tuple[int, int]]] = {dt: [] for dt in self.flats}
            for (k, pid), (dt, start, _n) in self.slots.items():
                lo, hi = self._range(k, *self.cuts[pid][self.shards.rank])
                if hi > lo:
                    own[dt].append((start + lo, start + hi))
            self._others = []
            for dt, ranges in own.items():
                end = 0
                for lo, hi in sorted(ranges) + [(self.flats[dt].numel(), self.flats[dt].numel())]:
                    if lo > end:
                        self._others.append(self.flats[dt][end:lo])
                    end = max(end, hi)
        for t in self._others:
            self.shards.shm.discard(t)
        for f in self.flats.values():  # and the peers' pages the refresh read: mapped here, theirs to keep
            self.shards.shm.unmap_peers(f)
        self._whole = False

    # -- the step ------------------------------------------------------------------------------------------
    def usable(self) -> bool:
        """The split needs identical gradients, params and state on every rank. A step after a backward under
        no_sync (e.g. local SGD) uses each rank's own gradients, so params and state diverge from then on:
        every later step is unsplit too. The same answer on every rank."""
        if not self.shards.grad_sync.in_sync:
            self.disabled = True
        return not self.disabled

    def begin(self) -> None:
        if self._whole:  # a refresh (state_dict) filled in the peers' slices: not needed for the step
            self._discard_peer_slices()
        self.shards.shm.barrier()  # A: no peer still reads its parameters (we write into its part)

    def end(self, stepped: list[tuple[torch.Tensor, int, int]]) -> None:
        self.shards.push(stepped)
        self.shards.shm.barrier()  # B: every slice is in every part before anyone's next forward
        self.stale = True

    def before_unsharded_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Every rank is about to step the whole optimizer itself (a configuration the kernels do not take):
        complete the state first, and wait so no rank overwrites a slice a peer is still reading."""
        if self.stale:
            self.refresh(optimizer)
            self.shards.shm.barrier()

    def suspend(self, optimizer: torch.optim.Optimizer) -> None:
        """From now on every rank steps everything with its own state (collective: every rank calls it at the same
        point, e.g. entering join_uneven_inputs, after which ranks step different numbers of times)."""
        if not self.disabled:
            self.before_unsharded_step(optimizer)
            self.disabled = True

    def remove(self) -> None:
        self._hook.remove()


def state_keys(optimizer: torch.optim.Optimizer) -> Optional[tuple[str, ...]]:
    """The per-parameter state tensors the fused kernels keep for this optimizer, or None when the sharded
    step cannot apply (another optimizer class)."""
    from ..optim._fused import optimizer_kind

    kind = optimizer_kind(optimizer)
    sds = {g.get("state_dtype", "float32") for g in optimizer.param_groups}
    if kind == "adam" and sds != {"float32"}:  # bf16 / 8-bit state (optim/lowbit.py; no amsgrad there)
        return ("exp_avg", "exp_avg_sq") + (("exp_avg_absmax", "exp_avg_sq_absmax") if "8bit" in sds else ())
    if kind == "adam":
        amsgrad = any(g.get("amsgrad", False) for g in optimizer.param_groups)
        return ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if amsgrad else ())
    if kind == "sgd":
        return ("momentum_buffer",) if any(g.get("momentum", 0) != 0 for g in optimizer.param_groups) else ()
    return None
