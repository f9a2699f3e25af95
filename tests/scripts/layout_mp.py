# tests/scripts/layout_mp.py: the parallel layout on 4 real processes (tests/test_layout_mp.py), several
# Accelerators one after the other in one run (the state is reset between them, the process group kept):
#   env:      Accelerator() under `launch --parallelism_config_dp_shard_size 2 --parallelism_config_tp_size 2`
#             (the PARALLELISM_CONFIG_* variables): coordinates, a collective over every group, the DeviceMesh
#             against HF's ParallelismConfig(dp_shard_size=2, tp_size=2).build_device_mesh("cpu"), the data each
#             rank reads against HF's prepare_data_loader given HF's mesh
#   dr_tp:    ParallelismConfig(dp_replicate_size=2, tp_size=2) (HF refuses it; we allow it): groups, data (sharded
#             and dispatched) against HF's BatchSamplerShard over the data-parallel ranks, gather_for_metrics over an
#             epoch, reduce / num_processes with HF's meaning, prepare(model) refused (no TP engine yet)
#   hsdp:     FSDP plugin + ParallelismConfig(dp_replicate_size=2, dp_shard_size=2): HF's HSDP on the sharded engine
#             over the layout's groups; 3 training steps against the single-process reference computed here
#   megatron: MegatronLMPlugin(tp_degree=2, sequence_parallelism=True): the same layout as dr_tp, no mesh (HF)
#   trivial:  Accelerator() without a config: data parallelism over the world
# Each rank writes OUT/rank<r>.json (what it saw); the checks against hand-written tables are in the test.
import json
import os
import sys

import torch
import torch.distributed as dist
from torch.utils.data import BatchSampler, DataLoader, SequentialSampler

from accelerate_c import Accelerator, ParallelismConfig
from accelerate_c.state import AcceleratorState, GradientState
from accelerate_c.utils import FullyShardedDataParallelPlugin, MegatronLMPlugin

N_SAMPLES, BATCH = 22, 3
OUT = sys.argv[1]


def reset() -> None:
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def groups(acc: Accelerator) -> dict:
    """Every group of the layout: its members, and an all_reduce / all_gather over it (CollectiveGroup and torch
    ProcessGroup) that must involve exactly those members."""
    layout, rank = acc.state.parallel_layout, acc.process_index
    out = {}
    for name in ("tp", "dp", "dp_replicate", "dp_shard", "pp", "cp"):
        d = layout.dim(name)
        t = torch.tensor([float(rank + 1)])
        d.group.all_reduce(t)
        g = torch.empty(d.size)
        d.group.all_gather(g, torch.tensor([float(rank)]))
        pg_sum = None
        if d.process_group is not None:
            t2 = torch.tensor([float(rank + 1)])
            dist.all_reduce(t2, group=d.process_group)
            pg_sum = t2.item()
        out[name] = {"ranks": d.ranks, "index": d.rank, "sum": t.item(), "gathered": g.tolist(), "pg_sum": pg_sum,
                     "solo": type(d.group).__name__ == "SoloGroup"}
    return out


def batches(acc: Accelerator, **loader_kw) -> tuple[list, list]:
    """The batches this rank reads over one epoch, and gather_for_metrics of each. With `loader_kw`
    (dispatch_batches, ...) the loader is prepared by prepare_data_loader with the layout's data-parallel ranks, as
    the Accelerator does."""
    dl = DataLoader(list(range(N_SAMPLES)), batch_size=BATCH, shuffle=False)
    if loader_kw:
        from accelerate_c.data_loader import prepare_data_loader
        layout = acc.state.parallel_layout
        dl = prepare_data_loader(dl, acc.device, put_on_device=True, num_processes=layout.dp_size,
                                 process_index=layout.dp_rank, **loader_kw)
    else:
        dl = acc.prepare(dl)
    seen, gathered = [], []
    for b in dl:
        seen.append(b.tolist())
        gathered.extend(acc.gather_for_metrics(b).tolist())
    return seen, gathered


def hf_shard(num: int, index: int) -> list:
    """HF's own BatchSamplerShard over the data-parallel ranks (the reference of what a dp rank reads)."""
    from accelerate.data_loader import BatchSamplerShard
    return list(BatchSamplerShard(BatchSampler(SequentialSampler(range(N_SAMPLES)), BATCH, False),
                                  num_processes=num, process_index=index))


def mesh_info(mesh) -> dict:
    names = list(mesh.mesh_dim_names)
    flat = {n: mesh[n].mesh.tolist() for n in ("dp", "dp_shard_cp", "dp_cp") if n in _flat_names(mesh)}
    return {"names": names, "mesh": mesh.mesh.tolist(), "flat": flat,
            "local": {n: mesh.get_local_rank(n) for n in names}}


def _flat_names(mesh) -> list:
    root = mesh._get_root_mesh() if hasattr(mesh, "_get_root_mesh") else mesh
    return list(getattr(root, "_flatten_mapping", {}).keys())


def case_env(res: dict) -> None:
    acc = Accelerator()
    pc = acc.parallelism_config
    from accelerate.parallelism_config import ParallelismConfig as HFConfig
    hf_mesh = HFConfig(dp_shard_size=2, tp_size=2).build_device_mesh("cpu")
    ours = mesh_info(acc.torch_device_mesh)
    seen, _ = batches(acc)
    from accelerate import PartialState as HFState
    from accelerate.data_loader import prepare_data_loader as hf_prepare
    HFState(cpu=True)
    hf_dl = hf_prepare(DataLoader(list(range(N_SAMPLES)), batch_size=BATCH), torch.device("cpu"), num_processes=4,
                       process_index=acc.process_index, torch_device_mesh=hf_mesh)
    res["env"] = {"sizes": [pc.dp_replicate_size, pc.dp_shard_size, pc.tp_size, pc.pp_size],
                  "layout": acc.state.parallel_layout.describe(), "groups": groups(acc),
                  "mesh": ours, "hf_mesh": mesh_info(hf_mesh), "seen": seen, "hf_seen": [b.tolist() for b in hf_dl],
                  "ranks": [acc.tensor_parallel_rank, acc.data_parallel_rank, acc.data_parallel_shard_rank]}
    for k in [k for k in os.environ if k.startswith("PARALLELISM_CONFIG_")] + ["ACCELERATE_USE_PARALLELISM_CONFIG"]:
        os.environ.pop(k, None)  # the later cases configure themselves


def refusal(acc: Accelerator) -> str:
    try:
        acc.prepare(torch.nn.Linear(2, 2))  # no TP plan: the engine at the seam names what is missing
    except ValueError as e:
        return str(e)
    return ""


def case_dr_tp(res: dict) -> None:
    acc = Accelerator(parallelism_config=ParallelismConfig(dp_replicate_size=2, tp_size=2))
    layout = acc.state.parallel_layout
    seen, gathered = batches(acc)
    dispatched, _ = batches(acc, dispatch_batches=True)
    red = acc.reduce(torch.tensor(float(acc.process_index)), reduction="sum").item()
    res["dr_tp"] = {"layout": layout.describe(), "groups": groups(acc), "seen": seen, "gathered": gathered,
                    "dispatched": dispatched, "hf_seen": hf_shard(layout.dp_size, layout.dp_rank),
                    "reduce_sum": red, "num_processes": acc.num_processes, "process_index": acc.process_index,
                    "gather_len": len(acc.gather(torch.zeros(2))), "refusal": refusal(acc),
                    "objects": acc.gather_for_metrics([f"r{layout.dp_rank}"], use_gather_object=True)}


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def case_hsdp(res: dict) -> None:
    acc = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2),
                      parallelism_config=ParallelismConfig(dp_replicate_size=2, dp_shard_size=2))
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(3, 8, 8, generator=g), torch.randn(3, 8, 4, generator=g)
    ref = _model()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    model = _model()
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    r = acc.state.parallel_layout.dp_rank
    for step in range(3):
        loss = torch.nn.functional.mse_loss(model(x[step, 2 * r:2 * r + 2]), y[step, 2 * r:2 * r + 2])
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        ref_loss = torch.nn.functional.mse_loss(ref(x[step]), y[step])
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
    full = acc.strategy.gather_state_dict(model, rank0_only=False)
    diff = max((full[k] - v).abs().max().item() for k, v in ref.state_dict().items())
    comm = acc.strategy.comm
    res["hsdp"] = {"max_diff": diff, "replicas": comm.replicas, "replica": comm.replica, "shard_size": comm.size,
                   "distributed_type": str(acc.distributed_type.value)}
    for k in [k for k in os.environ if k.startswith(("FSDP_", "ACCELERATE_USE_FSDP"))]:
        os.environ.pop(k)  # (an Accelerator given an FSDP plugin sets ACCELERATE_USE_FSDP, as HF's does)


def case_megatron(res: dict) -> None:
    acc = Accelerator(megatron_lm_plugin=MegatronLMPlugin(tp_degree=2, sequence_parallelism=True))
    res["megatron"] = {"layout": acc.state.parallel_layout.describe(), "mesh": acc.torch_device_mesh is None,
                       "tp_rank": acc.tensor_parallel_rank, "clip": acc.strategy.config.gradient_clipping,
                       "refusal": refusal(acc), "distributed_type": str(acc.distributed_type.value)}


def case_trivial(res: dict) -> None:
    acc = Accelerator()
    seen, gathered = batches(acc)
    res["trivial"] = {"layout": acc.state.parallel_layout.describe(), "mesh": acc.torch_device_mesh is None,
                      "seen": seen, "gathered": gathered, "hf_seen": hf_shard(4, acc.process_index)}


def main() -> None:
    res: dict = {}
    for case in (case_env, case_dr_tp, case_hsdp, case_megatron, case_trivial):
        case(res)
        AcceleratorState().wait_for_everyone()
        reset()
    rank = dist.get_rank()
    with open(os.path.join(OUT, f"rank{rank}.json"), "w") as fh:
        json.dump(res, fh)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
