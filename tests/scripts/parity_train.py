# tests/scripts/parity_train.py: one training script run under HF Accelerate or accelerate_c
# (--impl accelerate|accelerate_c), on 1 or N processes; writes per-step global losses and the final
# weights to --out (JSON + safetensors) on the main process. Used by tests/test_parity.py and
# tests/test_ddp_cross_host.py; `--cases FILE` runs several configurations in the same processes
# (tests/scripts/fold_cases.py).
# Not for: anything but comparing implementations and process counts on the same data and seed.
import argparse
import contextlib
import importlib
import json
import os
import sys
from datetime import timedelta

import torch

import fold_cases


def main(argv: list) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--impl", default="accelerate_c")
    p.add_argument("--out", required=True)
    p.add_argument("--global_batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--grad_accum", type=int, default=1)
    p.add_argument("--optimizer", default="adamw")
    p.add_argument("--shuffle", action="store_true")
    p.add_argument("--unused_param", action="store_true")
    p.add_argument("--mixed_precision", default="no")
    p.add_argument("--no_scheduler", action="store_true",
                   help="HF steps schedulers num_processes times per step, so N-vs-1 parity runs without one")
    p.add_argument("--comm_hook", default="no",
                   help="DistributedDataParallelKwargs(comm_hook=...): no|fp16|bf16|power_sgd|batched_power_sgd")
    p.add_argument("--comm_wrapper", default="no", help="DistributedDataParallelKwargs(comm_wrapper=...): no|fp16|bf16")
    p.add_argument("--comm_state", default="{}", help="DistributedDataParallelKwargs(comm_state_option=...), JSON")
    p.add_argument("--local_sgd", type=int, default=0, help="LocalSGD(local_sgd_steps=N) around the loop (0: none)")
    p.add_argument("--report_group", action="store_true",
                   help="accelerate_c only: write out/group<rank>.txt naming the DDP transport and comm group")
    p.add_argument("--timeout", type=float, default=None,
                   help="process-group (and comm) timeout in seconds (default: the library's, 30 min)")
    args = p.parse_args(argv)
    acc = importlib.import_module(args.impl)
    # the enum: HF's hook table is keyed by DDPCommunicationHookType, and a plain string is silently ignored there
    hook = acc.DDPCommunicationHookType(args.comm_hook)
    handlers = [acc.DistributedDataParallelKwargs(comm_hook=hook, comm_wrapper=acc.DDPCommunicationHookType(
        args.comm_wrapper), comm_state_option=json.loads(args.comm_state))] if args.comm_hook != "no" else []
    if args.timeout is not None:
        handlers.append(acc.InitProcessGroupKwargs(timeout=timedelta(seconds=args.timeout)))
    accelerator = acc.Accelerator(gradient_accumulation_steps=args.grad_accum, mixed_precision=args.mixed_precision,
                                  cpu=True, kwargs_handlers=handlers)
    torch.manual_seed(0)
    n = args.global_batch * args.steps * args.grad_accum
    x = torch.randn(n, 4)
    y = x @ torch.tensor([[1.5], [-2.0], [0.5], [3.0]]) + 0.1 * torch.randn(n, 1)
    ds = torch.utils.data.TensorDataset(x, y)
    per_proc = args.global_batch // accelerator.num_processes
    loader = torch.utils.data.DataLoader(ds, batch_size=per_proc, shuffle=args.shuffle)

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.l1, self.l2 = torch.nn.Linear(4, 16), torch.nn.Linear(16, 1)
            self.unused = torch.nn.Linear(16, 1) if args.unused_param else None

        def forward(self, inp: torch.Tensor) -> torch.Tensor:
            return self.l2(torch.tanh(self.l1(inp)))

    torch.manual_seed(1)
    model = Net()
    if args.optimizer == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.01)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    gamma = 1.0 if args.no_scheduler else 0.7
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=gamma)
    model, opt, loader, sched = accelerator.prepare(model, opt, loader, sched)
    losses = []
    local_sgd = contextlib.nullcontext()
    if args.local_sgd:
        local_sgd = importlib.import_module(f"{args.impl}.local_sgd").LocalSGD(accelerator, model, args.local_sgd)
    with local_sgd as lsgd:
        for xb, yb in loader:
            with accelerator.accumulate(model):
                out = model(xb)
                loss = torch.nn.functional.mse_loss(out, yb)
                accelerator.backward(loss)
                opt.step()
                sched.step()
                opt.zero_grad()
                if lsgd is not None:
                    lsgd.step()
            losses.append(accelerator.gather(loss.detach().reshape(1)).mean().item())
    if args.report_group:
        grp = getattr(accelerator.strategy, "bucket_group", None)  # the gradient buckets' CollectiveGroup
        inner = getattr(grp, "inner", grp)
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"group{accelerator.process_index}.txt"), "w") as f:
            f.write(f"{accelerator.num_processes} {type(inner).__name__}")
    state = accelerator.unwrap_model(model).state_dict()
    if accelerator.is_main_process:
        from safetensors.torch import save_file
        os.makedirs(args.out, exist_ok=True)
        save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(args.out, "weights.safetensors"))
        with open(os.path.join(args.out, "losses.json"), "w") as f:
            json.dump({"losses": losses, "lr": sched.get_last_lr()}, f)
    # every rank checks it holds the same parameters as rank 0, bit for bit
    flat = torch.cat([v.reshape(-1).float() for v in state.values()])
    ref = accelerator.gather(flat.unsqueeze(0))
    assert all(torch.equal(ref[0], ref[i]) for i in range(ref.shape[0])), "ranks hold different parameters"
    accelerator.wait_for_everyone()
    # HF's runs skip end_training: HF 1.15's teardown races (destroy_process_group right after the barrier sometimes
    # aborts a rank in gloo, "terminate called without an active exception", exit -6, after all results are
    # written). The baseline's own bug, not under test: its processes leave without tearing the group down.
    if args.impl == "accelerate_c":
        accelerator.end_training()


if __name__ == "__main__":
    fold_cases.run(main, sys.argv[1:])
    # Under torchrun (test_parity's comparison with HF) the interpreter's own teardown can race torch's gloo
    # worker threads and abort this finished process (see accelerate_c/commands/_bootstrap.py, which leaves
    # the same way for ranks of our launcher).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
