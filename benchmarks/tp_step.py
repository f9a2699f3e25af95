# benchmarks/tp_step.py: step time of the tensor-parallel engine (issue 21) on a transformers Llama built from a
# config (vocab 8192, hidden 512, FFN 2048, 8 layers, 8 heads, 8 KV heads, untied head: 41.9M parameters), batch
# 8 x 128 tokens (every TP rank gets the same batch), fused AdamW, fp32:
#   single:   one process, 2 threads (the baseline the TP step should match)
#   torch_tp: torch-native TP, `parallelize_module` (ColwiseParallel q/k/v/gate/up, RowwiseParallel o/down; the
#             embedding and LM head replicated) on gloo, 2 processes x 1 thread, `torch.distributed.run`
#   ours:     apply_tensor_parallel (the model's own plan: vocab-parallel embedding and LM head with the parallel
#             loss) over accelerate_c's shared-memory group, 2 processes x 1 thread, torch AdamW on the slices
#   ours_sp:  the same with sequence parallelism
#   single1:  (--kinds) one process, 1 thread: the compute of a whole step; each rank of ours should use about half
#             of its CPU seconds (the "CPU s/step per rank" column: process CPU time, worker threads included)
# Each worker times its steps; ours also times the TP collectives (the time a rank spends inside a collective call or
# waiting on an async one, so overlapped transfer does not count) and reports their share of the step. The driver
# interleaves the runs for --rounds rounds and prints medians and ratios.
# Targets: ours <= 1.1x single and <= 0.65x torch_tp; collectives <= 5 % of our step.
# Not for: correctness (tests/test_tensor_parallel.py).
# Run: python benchmarks/tp_step.py [--quick] [--no-record] [--rounds R] [--steps N] [--kinds single,ours,...]
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

from _results import append_results, run_ranks  # noqa: E402
from ddp_step import free_port  # noqa: E402

KINDS = ("single", "torch_tp", "ours", "ours_sp")
EXTRA_KINDS = ("single1",)   # one process x 1 thread: the whole step's compute, against ours' CPU seconds per rank
VOCAB, BATCH, SEQ = 8192, 8, 128


def make_model(layers: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=512, intermediate_size=2048, num_hidden_layers=layers,
                      num_attention_heads=8, num_key_value_heads=8, tie_word_embeddings=False)
    return LlamaForCausalLM(cfg)


def batches(n: int) -> list:
    import torch
    out = []
    for i in range(n):
        g = torch.Generator().manual_seed(i)
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
        out.append((ids, ids.clone()))
    return out


class TimedGroup:
    """Delegates to a CollectiveGroup; adds up the seconds spent in its calls and in wait() on its async works."""

    def __init__(self, inner) -> None:
        self.inner, self.rank, self.size, self.seconds = inner, inner.rank, inner.size, 0.0

    def _timed(self, fn, *a):
        t = time.perf_counter()
        out = fn(*a)
        self.seconds += time.perf_counter() - t
        return out

    def _work(self, work):
        group = self

        class Timed:
            def wait(self, timeout=None):
                return group._timed(work.wait)

            def is_completed(self):
                return work.is_completed()
        return Timed()

    def all_reduce(self, t, op="sum"):
        return self._timed(self.inner.all_reduce, t, op)

    def all_gather(self, o, i):
        return self._timed(self.inner.all_gather, o, i)

    def reduce_scatter(self, o, i, op="sum"):
        return self._timed(self.inner.reduce_scatter, o, i, op)

    def all_reduce_async(self, t, op="sum"):
        return self._work(self._timed(self.inner.all_reduce_async, t, op))

    def all_gather_async(self, o, i):
        return self._work(self._timed(self.inner.all_gather_async, o, i))

    def reduce_scatter_async(self, o, i, op="sum"):
        return self._work(self._timed(self.inner.reduce_scatter_async, o, i, op))


class Optimizers:
    """Fused AdamW; torch's fused kernel refuses a mix of DTensor and plain parameters, so those get one each."""

    def __init__(self, params) -> None:
        import torch
        from torch.distributed.tensor import DTensor
        params = list(params)
        groups = [[p for p in params if isinstance(p, DTensor)], [p for p in params if not isinstance(p, DTensor)]]
        self.opts = [torch.optim.AdamW(g, lr=1e-4, fused=True) for g in groups if g]

    def step(self) -> None:
        for o in self.opts:
            o.step()

    def zero_grad(self) -> None:
        for o in self.opts:
            o.zero_grad()


def _local(t):
    from torch.distributed.tensor import DTensor
    return t.to_local() if isinstance(t, DTensor) else t


def state_bytes(model, opt) -> int:
    """Bytes this rank holds in parameters, their gradients and the optimizer's state (distinct storages, measured
    after a step, gradients still attached)."""
    import torch
    seen, total = set(), 0
    tensors = [_local(p) for p in model.parameters()] + [_local(p.grad) for p in model.parameters()
                                                          if p.grad is not None]
    tensors += [_local(v) for o in opt.opts for st in o.state.values() for v in st.values()
                if isinstance(v, torch.Tensor)]
    for t in tensors:
        key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        if key not in seen:
            seen.add(key)
            total += key[1]
    return total


def activation_bytes(model, forward) -> int:
    """Bytes of the distinct storages autograd saves for backward during one forward (what a rank holds between
    forward and backward: measured with saved-tensor hooks), the parameters' own storages excluded; the graph is
    then released by a backward whose gradients are dropped."""
    import torch
    params = {_local(p).untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict = {}

    def pack(t):
        s = _local(t).untyped_storage()  # (a DTensor: its local shard's storage)
        if s.data_ptr() not in params:
            seen[s.data_ptr()] = s.nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = forward()
    loss.backward()
    model.zero_grad(set_to_none=True)
    return sum(seen.values())


def torch_tp(model):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    plan = {}
    for i in range(len(model.model.layers)):
        for n in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            plan[f"model.layers.{i}.{n}"] = ColwiseParallel()
        for n in ("self_attn.o_proj", "mlp.down_proj"):
            plan[f"model.layers.{i}.{n}"] = RowwiseParallel()
    return parallelize_module(model, mesh, plan)


def worker(args) -> None:
    import torch
    torch.set_num_threads(args.threads)
    rank, group = 0, None
    model = make_model(args.layers)
    if not args.worker.startswith("single"):
        import torch.distributed as dist
        dist.init_process_group("gloo")
        rank = dist.get_rank()
        if args.worker == "torch_tp":
            model = torch_tp(model)
        else:
            from accelerate_c.comm import get_group
            from accelerate_c.tensor_parallel import apply_tensor_parallel
            group = TimedGroup(get_group(None))
            apply_tensor_parallel(model, group, sequence_parallel=args.worker == "ours_sp")
    opt = Optimizers(model.parameters())
    times, comm, losses, cpu = [], [], [], []
    held = 0
    for ids, labels in batches(args.steps):
        c0 = group.seconds if group else 0.0
        t, p0 = time.perf_counter(), time.process_time()
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        opt.step()
        if not held:
            held = state_bytes(model, opt)
        opt.zero_grad()
        times.append(time.perf_counter() - t)
        cpu.append(time.process_time() - p0)
        comm.append((group.seconds - c0) if group else 0.0)
        losses.append(loss.item())
    ids, labels = batches(1)[0]
    acts = activation_bytes(model, lambda: model(input_ids=ids, labels=labels).loss)
    with open(f"{args.out}.{rank}.json", "w") as f:
        json.dump({"times": times, "comm": comm, "losses": losses, "cpu": cpu, "state": held, "acts": acts}, f)
    if not args.worker.startswith("single"):
        import torch.distributed as dist
        dist.barrier()
        dist.destroy_process_group()


def launch(kind: str, args, tmp: str) -> list[dict]:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = os.path.join(tmp, f"{kind}-{time.monotonic_ns()}")
    script = [os.path.abspath(__file__), "--worker", kind, "--out", out, "--steps", str(args.steps), "--layers",
              str(args.layers), "--threads", str(2 if kind == "single" else 1)]
    if kind.startswith("single"):
        env["OMP_NUM_THREADS"] = "2" if kind == "single" else "1"
        return run_ranks(kind, [sys.executable, *script], env, ROOT, out, 1, 3600)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           *script]
    return run_ranks(kind, cmd, env, ROOT, out, 2, 3600)


def main() -> None:
    p = argparse.ArgumentParser(description="tensor-parallel step time vs one process and torch-native TP")
    p.add_argument("--quick", action="store_true", help="1 round, 4 steps (1 warm-up)")
    p.add_argument("--no-record", action="store_true")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--kinds", default=",".join(KINDS))
    p.add_argument("--worker", choices=KINDS + EXTRA_KINDS, help=argparse.SUPPRESS)
    p.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    if args.quick:
        args.rounds, args.steps, args.warmup = 1, 4, 1
    kinds = args.kinds.split(",")
    step: dict[str, list[float]] = {k: [] for k in kinds}
    share: dict[str, list[float]] = {k: [] for k in kinds}
    cpu: dict[str, list[float]] = {k: [] for k in kinds}
    losses: dict[str, list[float]] = {}
    mem: dict[str, tuple[int, int]] = {}  # kind -> (max over ranks of param+grad+optimizer bytes, of activations)
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.rounds):
            for k in kinds:
                res = launch(k, args, tmp)
                w = args.warmup
                step[k].append(max(statistics.median(r["times"][w:]) for r in res))
                share[k].append(max(statistics.median([c / t for c, t in zip(r["comm"][w:], r["times"][w:])])
                                    for r in res))
                cpu[k].append(max(statistics.median(r["cpu"][w:]) for r in res))
                losses[k] = res[0]["losses"]
                mem[k] = (max(r["state"] for r in res), max(r["acts"] for r in res))
    med = {k: statistics.median(v) for k, v in step.items()}
    nparams = sum(p.numel() for p in make_model(args.layers).parameters())
    lines = [f"transformers Llama ({nparams / 1e6:.1f}M params, {args.layers} layers, hidden 512, FFN 2048, vocab "
             f"{VOCAB}), batch {BATCH}x{SEQ}, fp32, AdamW; single: 1 process x 2 threads, the others 2 processes x "
             f"1 thread at tp=2; {args.steps} steps ({args.warmup} warm-up), {args.rounds} interleaved round(s).", "",
             "| run | median s/step | / single | / torch_tp | TP collectives, share of the step | CPU s/step per rank |",
             "|---|---|---|---|---|---|"]
    for k in kinds:
        r_s = f"{med[k] / med['single']:.3f}" if "single" in med else "-"
        r_t = f"{med[k] / med['torch_tp']:.3f}" if "torch_tp" in med else "-"
        sh = f"{statistics.median(share[k]) * 100:.1f} %" if k.startswith("ours") else "-"
        lines.append(f"| {k} | {med[k]:.3f} | {r_s} | {r_t} | {sh} | {statistics.median(cpu[k]):.3f} |")
    ref = losses.get("single", losses.get("single1"))
    if ref is not None:
        lines += ["", "- per-step losses vs one process, max |diff|: " + ", ".join(
            f"{k} {max(abs(a - b) for a, b in zip(ref, v)):.2e}" for k, v in losses.items()
            if not k.startswith("single"))]
    base = mem.get("single", mem.get("single1"))
    if base:
        lines += ["", "| run | param + grad + optimizer MiB per rank | / one process | saved activations MiB per rank "
                  "| / one process |", "|---|---|---|---|---|"]
        for k, (st, ac) in mem.items():
            lines.append(f"| {k} | {st / 2**20:.1f} | {st / base[0]:.3f} | {ac / 2**20:.1f} | {ac / base[1]:.3f} |")
    lines.append("- targets: ours <= 1.1x single, <= 0.65x torch_tp; TP collectives <= 5 % of our step; per rank at "
                 "tp=2 <= 0.55x one process's param + grad + optimizer bytes; with SP, activations <= 0.6x tp=1's")
    lines.append("- per-round step medians (s): " + "; ".join(f"{k} {[round(x, 3) for x in v]}"
                                                            for k, v in step.items()))
    print("\n".join(lines))
    if not args.no_record and not args.quick:
        append_results("Tensor-parallel step time (benchmarks/tp_step.py)", lines)


if __name__ == "__main__":
    main()
