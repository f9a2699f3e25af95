# accelerate_c/sharding/construct.py: sharded construction, the engine's placement of a model that some rank built
# on the meta device (FSDP's cpu_ram_efficient_loading, DeepSpeed's zero3_init_flag, or none: a meta model is always
# materialised this way). Rank 0's values are what every rank ends with, as FSDP2's load from rank 0 and DeepSpeed's
# zero.Init broadcast give: rank 0 materialises and initialises its meta modules (materialize.py, post-order) or
# takes its real tensors as they are (it loaded pretrained weights); the other ranks never initialise anything.
# Unit by unit, in one schedule every rank computes from the module structure (the order in which units complete
# on rank 0), rank 0 packs the unit into a flat buffer (its parameters were materialised as views of it, so
# packing copies nothing) and
#   stage 3:   sends each rank its shard (one scatter over the shard group: each rank receives only its own shard;
#              HYBRID_SHARD: scatter on rank 0's host, then each shard broadcast to its replicas), then frees the unit:
#              a rank holds its shards plus at most one unit (rank 0: plus a unit whose tensors wait for a later
#              init, e.g. a root holding tied embeddings);
#   stage 1/2: broadcasts the unit into every rank's full flat buffer (the full parameters are what these stages
#              hold; construction writes them once, no second copy).
# Buffers and parameters outside the units (frozen, ignored) come whole from rank 0 afterwards (coalesced
# broadcast); ranks other than 0 allocate them first if they are meta.
# Not for: the initialisation rules (materialize.py), the steady-state buffers and hooks (engine.py, zero3.py).
from __future__ import annotations

from typing import Any, Optional

import torch

from .flat import FlatUnit
from .materialize import (_real_param, check_initializable, has_meta, materialize_model, materialize_stream,
                          release_points)


def construction_needed(model: torch.nn.Module, comm: Any) -> bool:
    """Collective over every rank: True when some rank's model has tensors on the meta device. Rank 0 also checks
    that it can initialise its meta modules, so that a module without reset_parameters is an error on every rank
    before any unit moves (the others would otherwise wait for units that never come)."""
    local = has_meta(model)
    err: Optional[ValueError] = None
    if comm.world.rank == 0 and local:
        try:
            check_initializable(model)
        except ValueError as e:
            err = e
    flags = torch.tensor([float(local), float(err is not None)], device=comm.device)
    comm.all_reduce(flags, "max", control=True, world=True)
    if err is not None:
        raise err
    if flags[1].item() > 0:
        raise ValueError(f"sharded construction: rank 0 cannot initialise its meta-device model (its error names the "
                         f"module); rank {comm.world.rank} stops too")
    return bool(flags[0].item() > 0)


def _bind(p: torch.nn.Parameter, view: torch.Tensor) -> None:
    if p.is_meta:
        _real_param(p, view)
    else:
        p.data = view


class _Placement:
    """One run of sharded construction for `engine` (a ShardEngine whose _place delegated to place_units)."""

    def __init__(self, engine: Any) -> None:
        self.e = engine
        self.comm = engine.comm
        self.world = engine.comm.world
        self.src = self.world.rank == 0
        self.device = engine.comm.device
        if self.src and self.comm.rank != 0:
            raise RuntimeError("sharded construction: world rank 0 must hold shard 0 of its replica")
        # stages 1/2 in fp32 without replicas: rank 0 materialises straight into its full flat buffer and the
        # broadcast reads it in place (every rank's view at the same offset of the shared region)
        self.in_place = engine.stage in (1, 2) and not engine.low and self.world is self.comm.group
        self.bufs: dict[int, torch.Tensor] = {}
        modules = [u.module for u in engine.units]
        rel = release_points(engine.model, modules)
        done = {u.index: max(rel[id(x.param)] for x in u.entries) for u in engine.units}
        self.order = sorted(engine.units, key=lambda u: (done[u.index], u.index))
        self.arrived = [0] * len(engine.units)
        self.next = 0

    # -- rank 0's unit buffers ---------------------------------------------------------------------------
    def _buf(self, u: FlatUnit) -> torch.Tensor:
        if self.in_place:
            return self.e.flat[u.fbase:u.fbase + u.padded]
        buf = self.bufs.get(u.index)
        if buf is None:
            buf = self.bufs[u.index] = torch.empty(u.padded, dtype=torch.float32, device=self.device)
        return buf

    def _alloc(self, name: str, t: torch.Tensor, is_param: bool) -> Optional[torch.Tensor]:
        i = self.e.index.get(id(t)) if is_param else None
        if i is None:
            return None
        x, u = self.e.entries[i], self.e.unit_of[i]
        return self._buf(u)[x.offset:x.offset + x.numel].view(x.shape)

    def _sink(self, name: str, t: torch.Tensor, is_param: bool) -> None:
        i = self.e.index.get(id(t)) if is_param else None
        if i is not None:
            self.arrived[self.e.unit_of[i].index] += 1
            self._drain()

    def _drain(self) -> None:
        while self.next < len(self.order):
            u = self.order[self.next]
            if self.arrived[u.index] < len(u.entries):
                return
            self.next += 1
            self._finish(u)

    # -- one unit, every rank ----------------------------------------------------------------------------
    def _finish(self, u: FlatUnit) -> None:
        e = self.e
        buf = None
        if self.src:
            buf = self._buf(u)
            for x, v in zip(u.entries, u.views(buf)):
                if x.param.data_ptr() != v.data_ptr():  # a real tensor (or one an init replaced): copy it in
                    v.copy_(x.param.data)
            buf[u.numel:].zero_()
        if e.stage in (1, 2):
            full = e.flat[u.fbase:u.fbase + u.padded]
            if self.in_place:
                self.world.broadcast(full, 0)
            else:
                tmp = buf if self.src else torch.empty(u.padded, dtype=torch.float32, device=self.device)
                self.world.broadcast(tmp, 0)
                full.copy_(tmp)
                if e.low:
                    e.master[u.base:u.base + u.shard].copy_(tmp[u.lo:u.hi])
            for x, v in zip(u.entries, u.views(full)):
                _bind(x.param, v)
        else:
            mine = e.pshard[u.base:u.base + u.shard]
            self._scatter(u, buf, mine)
            if e.low:
                e.lshard[u.base:u.base + u.shard].copy_(mine)
            full = buf if self.src and not e.low else torch.empty(u.padded, dtype=e.pdt, device=self.device)
            for x, v in zip(u.entries, u.views(full)):
                _bind(x.param, v)
            full.untyped_storage().resize_(0)  # zero3.py refills it in place when the unit is used
            u.full, u.gathered = full, False
        self.bufs.pop(u.index, None)

    def _scatter(self, u: FlatUnit, buf: Optional[torch.Tensor], mine: torch.Tensor) -> None:
        """Rank 0's unit `buf` -> every rank's shard `mine` (ranks holding the same shard on other hosts too)."""
        comm = self.comm
        if not u.shard:
            return
        if comm.replica == 0:  # rank 0's host (replica 0 of every shard): one scatter over the shard group
            comm.group.scatter(mine, buf[:u.padded] if self.src else None, 0)
        if comm.replicas > 1:  # HYBRID_SHARD: replica 0 of shard q (cross rank 0) -> the ranks holding q elsewhere
            import torch.distributed as dist
            dist.broadcast(mine, src=comm.cross_root, group=comm.cross)

    # -- the whole model -----------------------------------------------------------------------------------
    def run(self) -> None:
        e = self.e
        if self.src and has_meta(e.model):
            materialize_stream(e.model, self._sink, self.device, units=[u.module for u in e.units], alloc=self._alloc)
            if self.next != len(self.order):
                raise RuntimeError(f"sharded construction: units {[u.name for u in self.order[self.next:]]} were "
                                   "never completed by materialisation")
        else:
            for u in self.order:
                self._finish(u)
        self._rest()

    def _rest(self) -> None:
        """Buffers and the parameters outside every unit: rank 0's, whole, on every rank."""
        from ..comm.coalesced import broadcast_coalesced
        model, index = self.e.model, self.e.index
        if not self.src:
            allocate(model, self.device, skip=index)
        for m in model.modules():  # rank 0's real model may sit elsewhere (pretrained weights on the CPU)
            for key, b in list(m._buffers.items()):
                if b is not None and b.device != self.device:
                    m._buffers[key] = b.to(self.device)
            for p in m._parameters.values():
                if p is not None and id(p) not in index and p.device != self.device:
                    p.data = p.data.to(self.device)
        rest = [p for p in model.parameters() if id(p) not in index] + list(model.buffers())
        broadcast_coalesced(rest, lambda flat: self.world.broadcast(flat, 0))


def allocate(model: torch.nn.Module, device: torch.device, skip: Any = ()) -> None:
    """Every meta tensor of `model` (parameters whose id is in `skip` excepted) becomes uninitialised storage on
    `device`: what a rank that only receives rank 0's values needs (no init runs, no RNG is drawn)."""
    made: dict[int, torch.Tensor] = {}  # a buffer registered in several modules stays one tensor
    for m in model.modules():
        for key, b in list(m._buffers.items()):
            if b is not None and b.is_meta:
                if id(b) not in made:
                    made[id(b)] = torch.empty(b.shape, dtype=b.dtype, device=device)
                m._buffers[key] = made[id(b)]
        for p in m._parameters.values():
            if p is not None and p.is_meta and id(p) not in skip:
                _real_param(p, torch.empty(p.shape, dtype=p.dtype, device=device))


def materialize_whole(model: torch.nn.Module, device: torch.device, main: bool) -> None:
    """Stage 0 (NO_SHARD) and evaluation-mode preparation: the whole model on this rank, initialised on rank 0
    only; the caller broadcasts rank 0's values."""
    if main:
        materialize_model(model, device)
    else:
        allocate(model, device)


@torch.no_grad()
def place_units(engine: Any) -> _Placement:
    """Fills the engine's parameter buffers (flat / master / pshard / lshard, allocated by _place) from rank 0's
    model unit by unit and binds every unit parameter to its view, as _place does for a real model (collective)."""
    p = _Placement(engine)
    p.run()
    return p
