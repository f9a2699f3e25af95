# benchmarks/memory.py: the memory a rank's process holds, per strategy, side by side with torch (issue 20).
# A ~100M-parameter fp32 MLP built as users build it (no meta device: 24 Blocks of Linear(2048, 2048) + GELU, layers
# below glibc's largest mmap threshold, so what is freed lands in the heap as with most real models),
# AdamW, two steps on N processes (default 2), per rank:
#   PSS growth: proportional set size (shared pages divided among the processes that map them) after the second
#               step's optimizer.zero_grad() (set_to_none) minus after Accelerator() (imports and process group
#               done, model not built): the target figure. Nothing is trimmed by the script, except in
#               torch_fsdp2_trim (malloc_trim(0) after its steps, the reference for what FSDP2 needs).
#   USS growth: the pages only this process maps. RSS too.
#   tensor bytes alive: every torch tensor reachable by the garbage collector, storages counted once, split into
#               the module's parameters (as the user's model holds them), their .grad, the optimizer's state, and
#               the rest (the strategy's own flat buffers, staging, shared-memory windows...).
# Printed per rank: the PSS growth split into anonymous memory and shared memory (/proc/self/smaps_rollup).
# Kinds: torch_ddp, torch_fsdp2, torch_fsdp2_trim (torch.distributed.run, gloo), ddp, z1, z2, z3, fsdp (ours,
# `accelerate_c launch`; z<N> through DeepSpeedPlugin(zero_stage=N), fsdp through FSDP FULL_SHARD; one unit per
# Block), fsdp_glibc (fsdp with ACCELERATE_C_LARGE_TENSOR_PAGES=off: torch's and glibc's heap defaults instead of
# large tensors in mappings of their own, runtime/memory.py tune_cpu_heap). Ratios are against torch_ddp and
# torch_fsdp2_trim of the same run; several rounds give min-max ranges.
# Targets (issue 20): ddp <= 0.9x torch DDP, z2 <= 0.7x, z3/fsdp <= 0.55x torch DDP and <= 1.25x FSDP2 trimmed;
# at 3 processes z3 <= 0.4x torch DDP.
# Not for: step time (benchmarks/ddp_step.py, zero_step.py) or sharded construction (sharded_init.py).
# Run: python benchmarks/memory.py [--quick] [--no-record] [--rounds R] [--nproc N] [--kinds a,b]
from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from _results import append_results, run_ranks  # noqa: E402

KINDS = ("torch_ddp", "torch_fsdp2", "torch_fsdp2_trim", "ddp", "z1", "z2", "z3", "fsdp", "fsdp_glibc")
MiB = 1 << 20


def mem() -> dict:
    import psutil
    m = psutil.Process().memory_full_info()
    out = {"pss": m.pss, "uss": m.uss, "rss": m.rss}
    try:  # the PSS split: anonymous memory (heap, mmap) and shared memory (/dev/shm segments)
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                k, _, v = line.partition(":")
                if k in ("Pss_Anon", "Pss_Shmem"):
                    out[k.lower()] = int(v.split()[0]) * 1024
    except OSError:
        pass
    return out


def _shared_ranges() -> list[tuple[int, int]]:
    """Address ranges of this process's shared-memory mappings (/dev/shm files, memfds)."""
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            cols = line.split()
            if len(cols) >= 6 and (cols[5].startswith("/dev/shm/") or cols[5].startswith("/memfd:")):
                a, b = (int(x, 16) for x in cols[0].split("-"))
                out.append((a, b))
    return out


def tensor_bytes(model, opt) -> dict:
    """Bytes of the tensors alive, storages counted once: params / grads / optimizer state / the rest."""
    import torch
    seen: dict[int, int] = {}

    def key(t) -> tuple[int, int]:
        try:
            s = t.untyped_storage()
            return s.data_ptr(), s.nbytes()
        except Exception:  # noqa: BLE001 - e.g. a tensor subclass without storage
            return 0, 0

    shm = _shared_ranges()

    def add(ts, part: str, out: dict) -> None:
        for t in ts:
            if t is None or t.device.type == "meta":
                continue
            ptr, n = key(t)
            if ptr and ptr not in seen:
                seen[ptr] = n
                out[part] = out.get(part, 0) + n
                if any(a <= ptr < b for a, b in shm):
                    out["in_shm"] = out.get("in_shm", 0) + n
    with torch._C.DisableTorchFunctionSubclass():  # reading a ZeRO-3 stand-in must not gather it
        return _tensor_bytes(model, opt, add, seen)


def _tensor_bytes(model, opt, add, seen: dict) -> dict:
    import torch
    out: dict[str, int] = {}
    params = list(model.parameters())
    add(params, "params", out)
    add([p.grad for p in params], "grads", out)
    state = [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
    opt_params = [p for g in opt.param_groups for p in g["params"]]
    add(opt_params, "opt_params", out)  # the shard views a sharded optimizer steps
    add([p.grad for p in opt_params], "opt_grads", out)
    add(state, "opt_state", out)
    rest = []
    gc.collect()
    for o in gc.get_objects():
        try:
            if torch.is_tensor(o):
                rest.append(o)
        except Exception:  # noqa: BLE001 - objects whose isinstance check fails
            pass
    add(rest, "other", out)
    out["total"] = sum(seen.values())  # "in_shm": how much of it lies in shared-memory mappings
    return out


def make_model(args):
    import torch

    class Block(torch.nn.Module):
        def __init__(self, d: int) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(d, d)

        def forward(self, x):
            return torch.nn.functional.gelu(self.fc(x))
    torch.manual_seed(0)
    return torch.nn.Sequential(*[Block(args.width) for _ in range(args.layers)])


def trim() -> None:
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def steps(model, opt, backward, rank: int, args, after_step=None) -> None:
    import torch
    g = torch.Generator().manual_seed(rank)
    for _ in range(2):
        x = torch.randn(args.batch, args.width, generator=g)
        loss = model(x).pow(2).mean()
        backward(loss)
        opt.step()
        opt.zero_grad()
        if after_step is not None:
            after_step()


def worker(args) -> None:
    import torch
    torch.set_num_threads(1)
    out: dict = {}
    kind = args.worker
    if kind.startswith("torch_"):
        import torch.distributed as dist
        dist.init_process_group("gloo")
        rank = dist.get_rank()
        out["base"] = mem()
        model = make_model(args)
        if kind == "torch_ddp":
            model = torch.nn.parallel.DistributedDataParallel(model)
        else:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard
            mesh = init_device_mesh("cpu", (dist.get_world_size(),))
            for block in model:
                fully_shard(block, mesh=mesh)
            fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        out["prepared"] = mem()
        steps(model, opt, lambda loss: loss.backward(), rank, args, trim if kind.endswith("_trim") else None)
        out["end"] = mem()
        out["tensors"] = tensor_bytes(model, opt)
        dist.barrier()
        dist.destroy_process_group()
    else:
        import dataclasses
        from accelerate_c import Accelerator, DeepSpeedPlugin, FullyShardedDataParallelPlugin
        kw: dict = {}
        if kind.startswith("z"):
            kw["deepspeed_plugin"] = DeepSpeedPlugin(hf_ds_config={"train_micro_batch_size_per_gpu": args.batch,
                                                                   "zero_optimization": {"stage": int(kind[1])}})
        elif kind == "fsdp":
            kw["fsdp_plugin"] = FullyShardedDataParallelPlugin(sharding_strategy="FULL_SHARD",
                                                               auto_wrap_policy="transformer_based_wrap",
                                                               transformer_cls_names_to_wrap=["Block"])
        acc = Accelerator(**kw)
        if kind.startswith("z"):  # one unit per Block (DeepSpeed's JSON has no wrap policy)
            acc.strategy.config = dataclasses.replace(acc.strategy.config, auto_wrap_policy="transformer_based_wrap",
                                                      transformer_layer_cls=("Block",))
        rank = acc.process_index
        out["base"] = mem()
        model = make_model(args)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model, opt = acc.prepare(model, opt)
        out["prepared"] = mem()
        steps(model, opt, acc.backward, rank, args)
        out["end"] = mem()
        out["tensors"] = tensor_bytes(acc.unwrap_model(model), opt.optimizer if hasattr(opt, "optimizer") else opt)
        acc.wait_for_everyone()
        acc.end_training()
    with open(f"{args.out}.{rank}.json", "w") as f:
        json.dump(out, f)


def launch(kind: str, args, tmp: str) -> list[dict]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("ACCELERATE_USE_CPU", None)
    out = os.path.join(tmp, f"{kind}-{time.monotonic_ns()}")
    if kind.endswith("_glibc"):  # torch's and glibc's heap defaults (no tune_cpu_heap): what the policy changes
        env["ACCELERATE_C_LARGE_TENSOR_PAGES"] = "off"
    script = [os.path.abspath(__file__), "--worker", kind.removesuffix("_glibc"), "--out", out, "--width",
              str(args.width), "--layers", str(args.layers), "--batch", str(args.batch)]
    if kind.startswith("torch_"):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.nproc), *script]
    else:
        cmd = [sys.executable, "-m", "accelerate_c", "launch", "--cpu", "--num_processes", str(args.nproc),
               *script]
    return run_ranks(kind, cmd, env, ROOT, out, args.nproc, 900)


def _range(v: list[float]) -> str:
    return f"{min(v):,.0f}" if min(v) == max(v) else f"{min(v):,.0f}–{max(v):,.0f}"


def main() -> None:
    p = argparse.ArgumentParser(description="per-rank PSS growth per strategy vs torch DDP / FSDP2")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--no-record", action="store_true")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--kinds", default=",".join(KINDS))
    p.add_argument("--worker", choices=KINDS, help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    if args.quick:
        args.rounds, args.width, args.layers = 1, 1024, 4
    kinds = args.kinds.split(",")
    growth: dict[str, list[float]] = {k: [] for k in kinds}
    uss: dict[str, list[float]] = {k: [] for k in kinds}
    prep: dict[str, list[float]] = {k: [] for k in kinds}
    tensors: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.rounds):
            for k in kinds:
                res = launch(k, args, tmp)
                growth[k].append(max(r["end"]["pss"] - r["base"]["pss"] for r in res) / MiB)
                uss[k].append(max(r["end"]["uss"] - r["base"]["uss"] for r in res) / MiB)
                prep[k].append(max(r["prepared"]["pss"] - r["base"]["pss"] for r in res) / MiB)
                for r in res:
                    print(f"  rank: PSS growth anon {(r['end'].get('pss_anon', 0) - r['base'].get('pss_anon', 0)) / MiB:,.0f}"
                          f" shmem {(r['end'].get('pss_shmem', 0) - r['base'].get('pss_shmem', 0)) / MiB:,.0f} MiB")
                tensors[k] = max((r["tensors"] for r in res), key=lambda t: t["total"])
                print(f"{k}: PSS growth {growth[k][-1]:,.0f} MiB (after prepare {prep[k][-1]:,.0f}), "
                      f"tensors {tensors[k]['total'] / MiB:,.0f} MiB", flush=True)
    nparams = sum(q.numel() for q in make_model(args).parameters())
    med = {k: statistics.median(v) for k, v in growth.items()}
    ddp, f2 = med.get("torch_ddp"), med.get("torch_fsdp2_trim")
    parts = ("params", "grads", "opt_params", "opt_grads", "opt_state", "other")
    lines = [f"MLP {args.layers}x Linear({args.width}, {args.width}) ({nparams / 1e6:.1f}M fp32 params, "
             f"{nparams * 16 / MiB:,.0f} MiB at 16 B/param), AdamW, batch {args.batch}, two steps, "
             f"{args.nproc} processes x 1 thread, {args.rounds} interleaved round(s). PSS growth per rank (max over "
             "ranks) from after Accelerator() / init_process_group to after the second zero_grad(); "
             "median and min–max.", "",
             "| run | PSS growth MiB | range | / torch DDP | / FSDP2 trimmed | USS growth MiB | after prepare MiB | "
             "tensor bytes alive MiB (" + " / ".join(parts) + ") | of which in shared memory MiB |",
             "|---|---|---|---|---|---|---|---|---|"]
    for k in kinds:
        t = tensors[k]
        lines.append(f"| {k} | {med[k]:,.0f} | {_range(growth[k])} | {med[k] / ddp:.2f} | "
                     f"{'-' if not f2 else f'{med[k] / f2:.2f}'} | {statistics.median(uss[k]):,.0f} | "
                     f"{statistics.median(prep[k]):,.0f} | {t['total'] / MiB:,.0f} ("
                     + " / ".join(f"{t.get(x, 0) / MiB:,.0f}" for x in parts) + f") | {t.get('in_shm', 0) / MiB:,.0f} |"
                     if ddp else f"| {k} | {med[k]:,.0f} | {_range(growth[k])} | - | - | - | - | - | - |")
    lines += ["", "- tensor bytes count each storage's full size: a shared-memory region's storage spans every rank's part "
              "(mapped, mostly not resident here), so its column overstates what a rank holds; PSS is the measure."]
    print("\n".join(lines))
    if not args.no_record and not args.quick:
        append_results(f"Memory per rank (PSS), {args.nproc} processes", lines)


if __name__ == "__main__":
    main()
