# accelerate_c/sharding/placement.py: where a ShardEngine's memory lives: the flat buffers of its stage (stage 1/2:
# the full parameters and fp32 master shards; stage 3: the parameter shards and their compute copy; stage 1's full
# gradient buffer; the shard gradient and two reduce-scatter staging windows of ShardedConfig.staging_mb),
# and every unit parameter moved into its view of them. Sharded construction fills the same buffers from rank 0
# (construct.py).
# Not for: what the buffers mean during a step (engine.py) or the layout arithmetic (flat.py).
from __future__ import annotations

from typing import Any, Optional

import torch

from .views import raw_grad, set_raw_grad


def staging_window(staging_mb: float, world: int, itemsize: int) -> int:
    """Elements of each rank's shard one staging window of `staging_mb` MiB carries (a multiple of 16, at least 16)."""
    return max(16, int(staging_mb * (1 << 20)) // (world * itemsize) // 16 * 16)


def place_buffers(engine: Any) -> None:
    """Allocates the engine's flat buffers for its stage and moves every unit parameter into them."""
    comm, pdt = engine.comm, engine.pdt
    if engine.stage in (1, 2):
        engine.flat = comm.alloc(engine.full_numel, pdt)
        if engine.low:
            engine.master = comm.alloc(engine.shard_numel)  # fp32 master shards; flat holds the compute copy
    else:
        engine.pshard = comm.alloc(engine.shard_numel)
        if engine.low:
            engine.lshard = comm.alloc(engine.shard_numel, pdt)  # the shards' compute copy, what is gathered
    units = engine.units
    if engine.construct:  # the same buffers, filled from rank 0 unit by unit
        from .construct import place_units
        engine.placement = place_units(engine)
        units = []
    for u in units:
        f32 = torch.empty(u.padded, dtype=torch.float32, device=comm.device)
        u.pack(f32, [e.param.data for e in u.entries])
        if engine.stage in (1, 2):
            full = engine.flat[u.fbase:u.fbase + u.padded]
            full.copy_(f32)
            if engine.low:
                engine.master[u.base:u.base + u.shard].copy_(f32[u.lo:u.hi])
        else:
            engine.pshard[u.base:u.base + u.shard].copy_(f32[u.lo:u.hi])
            if engine.low:
                engine.lshard[u.base:u.base + u.shard].copy_(f32[u.lo:u.hi])
            full = f32 if not engine.low else f32.to(pdt)
            u.full, u.gathered = full, True
        for e, v in zip(u.entries, u.views(full)):
            e.param.data = v
    if engine.stage == 1:
        engine.gfull = comm.alloc(engine.full_numel, pdt)
        engine.gviews = [None] * len(engine.entries)
        for u in engine.units:
            for e, v in zip(u.entries, u.views(engine.gfull[u.fbase:u.fbase + u.padded])):
                if raw_grad(e.param) is not None:
                    v.copy_(raw_grad(e.param))
                set_raw_grad(e.param, v)
                engine.gviews[engine.index[id(e.param)]] = v
    if engine.stage != 1 or engine.split_reduce:
        # the shard gradient: its pages go back to the system at every full zero_grad (written again by the next
        # backward's reduce-scatters, which need no shared memory for their output)
        engine.gshard_pages = comm.alloc_pages(engine.shard_numel, engine.rdt)
        engine.gshard = (engine.gshard_pages.tensor if engine.gshard_pages is not None
                         else comm.alloc(engine.shard_numel, engine.rdt))
        # two staging windows: one packs while the previous one's reduce-scatter runs; a unit larger than a window
        # goes through in pieces (engine._reduce), so they cost staging_mb each, not a unit each
        biggest = max((u.padded for u in engine.units), default=0)
        engine.window = staging_window(getattr(engine.config, "staging_mb", 8.0), engine.world, engine.rdt.itemsize)
        size = min(biggest, engine.window * engine.world)
        pieces = sum(-(-u.shard // engine.window) for u in engine.units)
        engine.staging = [comm.alloc(size, engine.rdt) for _ in range(2 if pieces > 1 else 1)]
        engine._staging_work: list[Optional[Any]] = [None] * len(engine.staging)
        engine._next_staging = 0
    if engine.stage != 1:
        for e in engine.entries:
            set_raw_grad(e.param, None)
