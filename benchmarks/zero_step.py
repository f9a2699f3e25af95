# benchmarks/zero_step.py: step time of the sharded engine (issue 9) on the ~20M GPT of benchmarks/ddp_step.py
# (its model and batches), 2 processes x 1 thread, AdamW, each transformer Block one unit:
#   ddp:   our bucketed DDP (`accelerate_c launch`, no plugin), the baseline
#   z1/z2/z3: the sharded engine through DeepSpeedPlugin(zero_stage=1/2/3)
#   fsdp2: torch FSDP2 (`fully_shard` on every Block, then the root; gloo), `torch.distributed.run`
#   local: each of the 2 processes trains the plain model on its own batch, no process group, no collective
#          (torch's fused AdamW): the compute floor that every data-parallel step above contains
# Each run also times the optimizer step alone (opt.step()) per rank: under ZeRO a rank steps 1/N of the
# parameters. ddp_nosplit (ACCELERATE_C_SHARDED_STEP=0: every DDP rank steps every parameter) gives the
# per-rank step of plain DDP. The driver interleaves the runs for --rounds rounds and reports medians.
# z3_glibc: z3 with ACCELERATE_C_LARGE_TENSOR_PAGES=off (torch's and glibc's heap defaults; stage 3 is where the
# heap policy is on by default), for its step-time cost or gain. ddp_glibc, z1_glibc, z2_glibc (not in the default
# set: the policy is off for those stages already) serve the other comparison: run the driver with
# ACCELERATE_C_LARGE_TENSOR_PAGES=on and --kinds ddp,ddp_glibc,... (ddp then runs with the policy, ddp_glibc without).
# --bf16: the sharded stages under bf16 mixed precision (DeepSpeed bf16 block: a bf16 compute copy of fp32 master
# shards), each as z<N>_bf16 (the C paths: the pack kernel, the fused step writing the compute copy) and
# z<N>_bf16_torch (ACCELERATE_C_SHARD_KERNELS=0: torch copies and a separate cast after the step), with the ratio.
# Targets: Z1/Z2 <= 1.05x our DDP; Z3 <= 1.25x our DDP and <= 0.5x FSDP2; optimizer step DDP / ZeRO >= 1.8.
# Not for: correctness (tests/test_sharded_engine.py) or the DDP cost against HF (benchmarks/ddp_step.py).
# Run: python benchmarks/zero_step.py [--quick] [--no-record] [--rounds R] [--steps N]
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from ddp_step import add_model_args, free_port, make_batches, make_model  # noqa: E402  (the same model and data)
from _results import append_results, run_ranks  # noqa: E402

KINDS = ("ddp", "ddp_nosplit", "z1", "z2", "z3", "z3_glibc", "fsdp2", "local")
BF16_KINDS = ("z1_bf16", "z1_bf16_torch", "z2_bf16", "z2_bf16_torch", "z3_bf16", "z3_bf16_torch")


def timed_steps(model, opt, batches, backward, strategy=None) -> tuple[list[float], list[float], list[float]]:
    """Step times, optimizer times (the strategy's own measure of the optimizer on the shard when it has one:
    opt.step() there also holds the all-gather), losses."""
    steps, opt_times, losses = [], [], []
    for x, y in batches:
        t = time.perf_counter()
        loss = model(x, y)
        backward(loss)
        t_opt = time.perf_counter()
        opt.step()
        opt_times.append(time.perf_counter() - t_opt if not getattr(strategy, "step_seconds", None)
                         else strategy.step_seconds["optimizer"])
        opt.zero_grad()
        steps.append(time.perf_counter() - t)
        losses.append(loss.item())
    return steps, opt_times, losses


def worker(args) -> None:
    import torch
    torch.set_num_threads(1)
    out: dict = {}
    if args.worker == "local":
        rank = int(os.environ.get("RANK", "0"))
        model = make_model(args)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, fused=True)
        out["times"], out["opt_times"], out["losses"] = timed_steps(model, opt, make_batches(args, rank),
                                                                    lambda l: l.backward())
    elif args.worker == "fsdp2":
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        dist.init_process_group("gloo")
        rank = dist.get_rank()
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        model = make_model(args)
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
        out["times"], out["opt_times"], out["losses"] = timed_steps(model, opt, make_batches(args, rank),
                                                                    lambda l: l.backward())
        dist.barrier()
        dist.destroy_process_group()
    else:
        import dataclasses
        from accelerate_c import Accelerator
        from accelerate_c import DeepSpeedPlugin
        plugin = None
        if args.worker.startswith("z"):
            ds = {"train_micro_batch_size_per_gpu": args.batch, "zero_optimization": {"stage": int(args.worker[1])}}
            if args.bf16:
                ds["bf16"] = {"enabled": True}
            plugin = DeepSpeedPlugin(hf_ds_config=ds)
        acc = Accelerator(deepspeed_plugin=plugin, mixed_precision="bf16" if args.bf16 else "no")
        if plugin is not None:  # one unit per Block (DeepSpeed's JSON has no wrap policy; FSDP2's would be the same)
            acc.strategy.config = dataclasses.replace(acc.strategy.config, auto_wrap_policy="transformer_based_wrap",
                                                      transformer_layer_cls=("Block",))
        model = make_model(args)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
        model, opt = acc.prepare(model, opt)
        rank = acc.process_index
        out["strategy"] = acc.strategy.name
        out["times"], out["opt_times"], out["losses"] = timed_steps(model, opt, make_batches(args, rank), acc.backward,
                                                                    acc.strategy)
        if plugin is not None:
            out["bytes_per_step"] = acc.strategy.bytes_last_step
            out["state_bytes"] = acc.strategy.model_state_bytes([opt])
        acc.wait_for_everyone()
        acc.end_training()
    with open(f"{args.out}.{rank}.json", "w") as f:
        json.dump(out, f)


def worker_args(args) -> list[str]:
    return ["--steps", str(args.steps), "--warmup", str(args.warmup), "--batch", str(args.batch), "--seq",
            str(args.seq), "--n_layer", str(args.n_layer), "--n_embd", str(args.n_embd), "--n_head",
            str(args.n_head), "--seed", str(args.seed)]


def launch(kind: str, args, tmp: str) -> list[dict]:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("ACCELERATE_USE_CPU", None)
    out = os.path.join(tmp, f"{kind}-{time.monotonic_ns()}")
    script = [os.path.abspath(__file__), "--worker", kind.split("_")[0], "--out", out, *worker_args(args)]
    if "_bf16" in kind:
        script.append("--bf16")
    if kind.endswith("_torch"):
        env["ACCELERATE_C_SHARD_KERNELS"] = "0"
    if kind == "ddp_nosplit":
        env["ACCELERATE_C_SHARDED_STEP"] = "0"
    if kind.endswith("_glibc"):  # torch's and glibc's heap defaults (no tune_cpu_heap): the policy's cost or gain
        env["ACCELERATE_C_LARGE_TENSOR_PAGES"] = "off"
    if kind == "fsdp2":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
               str(free_port()), *script]
    else:
        cmd = [sys.executable, "-m", "accelerate_c", "launch", "--cpu", "--num_processes", "2",
               "--main_process_port", str(free_port()), *script]
    return run_ranks(kind, cmd, env, ROOT, out, 2, 1800)


def main() -> None:
    p = argparse.ArgumentParser(description="ZeRO 1/2/3 step time vs our DDP and torch FSDP2")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--no-record", action="store_true")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=3)
    add_model_args(p)
    p.add_argument("--kinds", default=None, help=f"default: {','.join(KINDS)} ({','.join(BF16_KINDS)} with --bf16)")
    p.add_argument("--bf16", action="store_true", help="the sharded stages in bf16, C paths vs torch copies")
    p.add_argument("--worker", choices=["ddp", "z1", "z2", "z3", "fsdp2", "local"], help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    if args.quick:
        args.rounds, args.steps, args.warmup = 1, 5, 2
    kinds = (args.kinds or ",".join(BF16_KINDS if args.bf16 else KINDS)).split(",")
    step: dict[str, list[float]] = {k: [] for k in kinds}
    optstep: dict[str, list[float]] = {k: [] for k in kinds}
    extra: dict[str, dict] = {}
    losses: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.rounds):
            for k in kinds:
                res = launch(k, args, tmp)
                w = args.warmup
                step[k].append(statistics.median(res[0]["times"][w:]))
                optstep[k].append(statistics.median([statistics.median(r["opt_times"][w:]) for r in res]))
                losses[k] = res[0]["losses"]
                extra[k] = {key: res[0][key] for key in ("bytes_per_step", "state_bytes") if key in res[0]}
    med = {k: statistics.median(v) * 1e3 for k, v in step.items()}
    omed = {k: statistics.median(v) * 1e3 for k, v in optstep.items()}
    nparams = sum(p.numel() for p in make_model(args).parameters())
    base = med.get("ddp")
    lines = [f"GPT {args.n_layer}x{args.n_embd} ({nparams / 1e6:.2f}M params), AdamW, per-process batch "
             f"{args.batch}x{args.seq}, 2 processes x 1 thread, {args.steps} steps ({args.warmup} warm-up), "
             f"{args.rounds} interleaved round(s); ZeRO via DeepSpeedPlugin(zero_stage), one unit per Block.", "",
             "| run | median step ms | / our DDP | / FSDP2 | optimizer step ms (per rank) | bytes/step (counted) | "
             "model-state bytes/rank |", "|---|---|---|---|---|---|---|"]
    for k in kinds:
        r_ddp = f"{med[k] / base:.3f}" if base else "-"
        r_f = f"{med[k] / med['fsdp2']:.3f}" if "fsdp2" in med else "-"
        b = extra[k].get("bytes_per_step")
        s = extra[k].get("state_bytes")
        lines.append(f"| {k} | {med[k]:.1f} | {r_ddp} | {r_f} | {omed[k]:.1f} | "
                     f"{'-' if b is None else f'{b / 1e6:.1f} MB'} | {'-' if s is None else f'{s / 1e6:.1f} MB'} |")
    ref = losses.get("ddp")
    if ref:  # (local: rank 0 trains on its own batch only, so its losses are not the data-parallel ones)
        diffs = {k: max(abs(a - b) for a, b in zip(ref, v)) for k, v in losses.items() if k != "local"}
        lines += ["", "- per-step losses vs our DDP, max |diff|: " + ", ".join(f"{k} {d:.2e}" for k, d in diffs.items())]
    if "local" in med and "fsdp2" in med:
        lines.append(f"- compute floor (local: no collective) {med['local']:.1f} ms vs 0.5x FSDP2 = "
                     f"{0.5 * med['fsdp2']:.1f} ms; z3 above the floor: "
                     + (f"{med['z3'] - med['local']:.1f} ms" if "z3" in med else "-"))
    if "ddp_nosplit" in omed:
        for z in ("z1", "z2", "z3"):
            if z in omed:
                lines.append(f"- optimizer step per rank, DDP (every rank steps all) / {z}: "
                             f"{omed['ddp_nosplit'] / omed[z]:.2f}x (target >= 1.8)")
    for z in ("z1", "z2", "z3"):
        c, t = f"{z}_bf16", f"{z}_bf16_torch"
        if c in med and t in med:
            lines.append(f"- {z} bf16 step, torch copies + separate cast / C pack + fused compute-copy write: "
                         f"{med[t] / med[c]:.3f}x (losses bit-identical: {losses[c] == losses[t]})")
    lines.append(f"- per-round step medians (ms): " + "; ".join(f"{k} {[round(x * 1e3, 1) for x in v]}"
                                                              for k, v in step.items()))
    print("\n".join(lines))
    if not args.no_record and not args.quick:
        title = "ZeRO bf16 step time, C paths vs torch copies" if args.bf16 else "ZeRO step time"
        append_results(f"{title} (benchmarks/zero_step.py)", lines)


if __name__ == "__main__":
    main()
