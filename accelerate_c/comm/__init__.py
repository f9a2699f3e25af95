# accelerate_c.comm: collectives for the strategies: the shared-memory transport between ranks of one host
# (shm.ShmGroup), the host-hierarchical composition over torch.distributed (hierarchical.HierarchicalGroup)
# and get_group(), which picks one of them (or plain torch.distributed) for a process group; transport.py
# (the collectives under runtime/operations.py) and outbuf.py (page-resident memory for their large results)
# are imported by name.
# Not for: gradient bucketing or any model logic (strategies/ do that).
from accelerate_c.comm.group import CollectiveGroup, TorchGroup, get_group, host_id, release_groups
from accelerate_c.comm.hierarchical import HierarchicalGroup
from accelerate_c.comm.shm import ShmGroup, Work

__all__ = ["CollectiveGroup", "TorchGroup", "HierarchicalGroup", "ShmGroup", "Work", "get_group", "host_id",
           "release_groups"]
