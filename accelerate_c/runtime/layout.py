# accelerate_c/runtime/layout.py: ParallelLayout, the one object that holds a run's parallel degrees
# (pp x dp_replicate x dp_shard x cp x tp = world size), this rank's coordinate in each dimension, one group per
# dimension (a torch ProcessGroup and an accelerate_c CollectiveGroup: shared memory within a host) and, on demand,
# torch's DeviceMesh with HF's dimension names. It always exists on the AcceleratorState: without a parallel config
# it is the trivial layout (every degree 1 but the data-parallel one = the world: dp_shard under FSDP/DeepSpeed,
# dp_replicate otherwise). Engines take their groups from it explicitly; nothing reads a global group.
#
# Rank order (row-major over DIMS, the last dimension varies fastest, as torchtitan and HF's DeviceMesh):
#   rank = (((pp * DR + dr) * DS + ds) * CP + cp) * TP + tp
# so the ranks of one TP group are neighbours (tp innermost: on one host when tp <= ranks per host) and the
# pipeline stage is the outermost coordinate. "dp" is dp_replicate x dp_shard flattened (dr-major, HF's "dp"):
# dp_rank = dr * DS + ds, the data-parallel rank the data loaders shard by (every rank of a TP/CP/PP group
# reads the same batch).
# Groups: a dimension of size 1 has `process_group` None (never pass it to torch: None means the world there) and a
# SoloGroup (size 1, identity collectives) as `group`, so callers never branch on the size; a dimension spanning
# the world has torch's WORLD group and the process-wide accelerate_c group (comm.get_group()). The torch groups
# are made at build_groups() (collective: every rank, same order); the CollectiveGroups on first use (collective
# over that dimension's ranks); the DeviceMesh on first use of torch_device_mesh (collective over every rank).
# Not for: reading the user's config or plugin and deciding what is implemented (layout_build.py), the faces
# (base/parallelism_config.py, base/megatron_plugin.py) or any engine.
from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, Optional

import torch.distributed as dist

from ..base.process_local import ProcessLocal

DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")  # outermost first
GROUPS = {"pp": ("pp",), "dp_replicate": ("dp_replicate",), "dp_shard": ("dp_shard",), "cp": ("cp",),
          "tp": ("tp",), "dp": ("dp_replicate", "dp_shard"),
          "model": ("pp", "cp", "tp")}  # the groups a layout offers, by name ("model": the ranks of one replica)
NON_DATA = ("pp", "cp", "tp")  # dimensions whose ranks read the same batch


@dataclass(frozen=True)
class Degrees:
    """The size of every dimension (1 = not used)."""

    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"parallel layout: the {f.name} degree must be an integer >= 1, got {v!r}")

    @property
    def world(self) -> int:
        return math.prod(getattr(self, d) for d in DIMS)

    def size(self, dims: tuple[str, ...]) -> int:
        return math.prod(getattr(self, d) for d in dims)


def coordinates(degrees: Degrees, rank: int) -> dict[str, int]:
    """The coordinate of global `rank` in every dimension (see the rank order above)."""
    if not 0 <= rank < degrees.world:
        raise ValueError(f"parallel layout: rank {rank} outside a world of {degrees.world}")
    out, rest = {}, rank
    for d in reversed(DIMS):
        out[d], rest = rest % getattr(degrees, d), rest // getattr(degrees, d)
    return out


def rank_of(degrees: Degrees, coords: dict[str, int]) -> int:
    rank = 0
    for d in DIMS:
        rank = rank * getattr(degrees, d) + coords.get(d, 0)
    return rank


def group_ranks(degrees: Degrees, rank: int, dims: tuple[str, ...]) -> list[int]:
    """The global ranks that share every coordinate of `rank` outside `dims`, ascending (= their order in the
    group: row-major over `dims`)."""
    mine = coordinates(degrees, rank)
    out = [0]
    for d in DIMS:
        n = getattr(degrees, d)
        coords = range(n) if d in dims else [mine[d]]
        out = [r * n + c for r in out for c in coords]
    return out


def partition(degrees: Degrees, dims: tuple[str, ...]) -> list[list[int]]:
    """Every group of `dims` (the world cut into them), ordered by their first rank."""
    seen, out = set(), []
    for r in range(degrees.world):
        if r not in seen:
            g = group_ranks(degrees, r, dims)
            seen.update(g)
            out.append(g)
    return out


class DimGroup:
    """One group of the layout: its name, size, this rank's index in it (= its coordinate), the global ranks in
    group order, the torch ProcessGroup (None when the size is 1) and the accelerate_c CollectiveGroup (`group`)."""

    def __init__(self, name: str, ranks: list[int], rank: int, process_group: Any, world: bool) -> None:
        self.name, self.ranks, self.size = name, ranks, len(ranks)
        self.rank = ranks.index(rank)
        self.process_group = process_group
        self._world = world
        self._group: Optional[Any] = None

    @property
    def group(self) -> Any:
        """The CollectiveGroup (built on first use: collective over this group's ranks)."""
        if self._group is None:
            if self.size == 1:
                from ..comm.solo import SoloGroup
                self._group = SoloGroup()
            else:
                from ..comm import get_group
                self._group = get_group(None if self._world else self.process_group)
        return self._group

    def __repr__(self) -> str:
        return f"DimGroup({self.name}: ranks {self.ranks}, index {self.rank})"

    def __reduce_ex__(self, protocol: int) -> Any:
        """A group of one rank pickles by value; a wider one holds a live process group (process_local.py)."""
        if self.size > 1:
            return ProcessLocal.__reduce_ex__(self, protocol)
        return object.__reduce_ex__(self, protocol)


class ParallelLayout:
    """The degrees, coordinates and groups of one run (see the module header)."""

    def __init__(self, degrees: Degrees, rank: int, *, device_type: str = "cpu", sequence_parallel: bool = False,
                 num_micro_batches: int = 1, gradient_clipping: Optional[float] = None, mesh_config: Any = None,
                 source: str = "none", pp_schedule: str = "1f1b", pp_virtual_stages: int = 1) -> None:
        self.degrees = degrees
        self.rank = rank
        self.coords = coordinates(degrees, rank)
        self.device_type = device_type
        self.sequence_parallel = bool(sequence_parallel) and degrees.tp > 1
        self.num_micro_batches = int(num_micro_batches)
        self.pp_schedule, self.pp_virtual_stages = pp_schedule, int(pp_virtual_stages)
        self.gradient_clipping = gradient_clipping
        self.source = source  # "none" (trivial) | "parallelism_config" | "megatron_lm"
        self._mesh_config = mesh_config
        self._mesh: Any = None
        self._pgs: dict[tuple[int, ...], Any] = {}
        self._dims: dict[str, DimGroup] = {}
        self._built = False

    # -- sizes and coordinates ---------------------------------------------------------------------------------
    world_size = property(lambda self: self.degrees.world)
    pp = property(lambda self: self.degrees.pp)
    dp_replicate = property(lambda self: self.degrees.dp_replicate)
    dp_shard = property(lambda self: self.degrees.dp_shard)
    cp = property(lambda self: self.degrees.cp)
    tp = property(lambda self: self.degrees.tp)
    pp_rank = property(lambda self: self.coords["pp"])
    dp_replicate_rank = property(lambda self: self.coords["dp_replicate"])
    dp_shard_rank = property(lambda self: self.coords["dp_shard"])
    cp_rank = property(lambda self: self.coords["cp"])
    tp_rank = property(lambda self: self.coords["tp"])

    @property
    def dp_size(self) -> int:
        """dp_replicate x dp_shard: the number of distinct batches per step."""
        return self.degrees.dp_replicate * self.degrees.dp_shard

    @property
    def dp_rank(self) -> int:
        """This rank's data-parallel index (which batch it reads)."""
        return self.coords["dp_replicate"] * self.degrees.dp_shard + self.coords["dp_shard"]

    @property
    def data_replicated(self) -> bool:
        """True when several ranks read the same batch (a TP, CP or PP dimension > 1)."""
        return any(getattr(self.degrees, d) > 1 for d in NON_DATA)

    @property
    def is_trivial(self) -> bool:
        """Only data parallelism over the whole world (no parallel config, or one that asks for no more)."""
        return not self.data_replicated and self.dp_size == self.world_size and \
            (self.dp_replicate == 1 or self.dp_shard == 1)

    def data_representatives(self) -> list[int]:
        """One global rank per data-parallel index, in dp order: the rank of each dp coordinate whose other
        coordinates are 0 (what gather_for_metrics keeps when a batch is replicated)."""
        return group_ranks(self.degrees, rank_of(self.degrees, {}), GROUPS["dp"])

    # -- groups --------------------------------------------------------------------------------------------------
    def build_groups(self) -> None:
        """Creates the torch process group of every dimension (and of "dp") of size > 1 that is not the whole world.
        Collective over every rank: every rank creates every group, in one fixed order (torch's new_group rule)."""
        if self._built:
            return
        world = self.world_size
        if world > 1:
            if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() != world:
                got = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
                raise RuntimeError(f"parallel layout of {world} processes built in a world of {got}")
            for name, dims in GROUPS.items():
                if 1 < self.degrees.size(dims) < world:
                    for ranks in partition(self.degrees, dims):
                        key = tuple(ranks)
                        if key not in self._pgs:
                            pg = dist.new_group(list(ranks))
                            if self.rank in ranks:
                                self._pgs[key] = pg
        self._built = True

    def dim(self, name: str) -> DimGroup:
        """The group called `name` ("tp", "dp", "dp_replicate", "dp_shard", "pp", "cp", "model": pp x cp x tp, the
        ranks that together hold one replica of the model and see different gradients) this rank belongs to."""
        if name not in GROUPS:
            raise ValueError(f"parallel layout: no group named {name!r}; allowed: {', '.join(GROUPS)}")
        found = self._dims.get(name)
        if found is None:
            ranks = group_ranks(self.degrees, self.rank, GROUPS[name])
            whole = len(ranks) == self.world_size and len(ranks) > 1
            if len(ranks) == 1:
                pg = None
            elif whole:
                pg = dist.group.WORLD
            else:
                self.build_groups()
                pg = self._pgs[tuple(ranks)]
            found = self._dims[name] = DimGroup(name, ranks, self.rank, pg, whole)
        return found

    tp_group = property(lambda self: self.dim("tp").group, doc="The TP CollectiveGroup (SoloGroup when tp == 1).")
    dp_group = property(lambda self: self.dim("dp").group, doc="dp_replicate x dp_shard, flattened.")
    dp_replicate_group = property(lambda self: self.dim("dp_replicate").group)
    dp_shard_group = property(lambda self: self.dim("dp_shard").group)
    pp_group = property(lambda self: self.dim("pp").group)
    cp_group = property(lambda self: self.dim("cp").group)

    # -- HF's face -----------------------------------------------------------------------------------------------
    @property
    def torch_device_mesh(self) -> Any:
        """torch's DeviceMesh with HF's dimension names, order and flattened dimensions ("dp", "dp_shard_cp",
        "dp_cp"), pp outermost; None on one process. Built on first use: collective over every rank."""
        if self._mesh is None and self.world_size > 1:
            self._mesh = self.mesh_config().get_device_mesh(self.device_type)
        return self._mesh

    def mesh_config(self) -> Any:
        """The ParallelismConfig the mesh is built from: the user's, else one with this layout's degrees."""
        if self._mesh_config is None:
            from ..base.parallelism_config import ParallelismConfig
            d = self.degrees
            self._mesh_config = ParallelismConfig(dp_replicate_size=d.dp_replicate, dp_shard_size=d.dp_shard,
                                                  tp_size=d.tp, cp_size=d.cp, cp_backend="torch", sp_size=1,
                                                  sp_backend="deepspeed", pp_size=d.pp)
        return self._mesh_config

    def describe(self) -> dict[str, Any]:
        """Degrees, coordinates and this rank's group members, as plain data (logs, tests)."""
        return {"degrees": {d: getattr(self.degrees, d) for d in DIMS}, "rank": self.rank, "coords": dict(self.coords),
                "dp_size": self.dp_size, "dp_rank": self.dp_rank, "sequence_parallel": self.sequence_parallel,
                "num_micro_batches": self.num_micro_batches, "gradient_clipping": self.gradient_clipping,
                "groups": {n: group_ranks(self.degrees, self.rank, dims) for n, dims in GROUPS.items()},
                "source": self.source}

    def __repr__(self) -> str:
        sizes = " x ".join(f"{d}={getattr(self.degrees, d)}" for d in DIMS)
        return f"ParallelLayout({sizes}; rank {self.rank} at {self.coords})"
