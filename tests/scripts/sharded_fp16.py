# tests/scripts/sharded_fp16.py: fp16 loss scaling through Accelerator(mixed_precision="fp16") with an FSDP plugin
# or a DeepSpeedPlugin whose JSON has an "fp16" block, on one process (the reference) or several (the sharded
# engine, stages 1-3). An inf can be injected into ONE element of rank 0's gradient at chosen steps: after the
# reduce-scatter only the rank owning that element sees it in its shard, so the others skip only if the overflow
# decision is agreed. Writes, per rank, record<r>.json: skipped flags and the scale after each step, the final
# scaler state_dict, whether a save_state/load_state round trip restored it, what accelerator.get_state_dict gave
# (its dtypes, None, or HF's error) and, with --save_model, whether the file holds exactly that dict; rank 0 also
# weights.safetensors (fp32). --cases FILE: several runs one after another in the same processes (fold_cases.py).
# Not for: the engine's other features (sharded_train.py).
import argparse
import json
import os
import sys

import torch
from safetensors.torch import save_file

import fold_cases


def build() -> torch.nn.Module:
    torch.manual_seed(3)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def batch(step: int, n: int) -> tuple:
    g = torch.Generator().manual_seed(50 + step)
    x = torch.randn(n, 8, generator=g)
    return x, x[:, :4].sin()


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    p.add_argument("--face", choices=("fsdp", "ds"), default="fsdp")
    p.add_argument("--stage", type=int, default=3)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--global_batch", type=int, default=8)
    p.add_argument("--inject", default="", help="comma-separated steps at which rank 0 gets one inf gradient")
    p.add_argument("--fp16", default="{}", help="DeepSpeed face: the JSON fp16 block (enabled added)")
    p.add_argument("--scaler", default="{}", help="FSDP face: GradScalerKwargs as JSON")
    p.add_argument("--clip", type=float, default=0.0, help="accelerator.clip_grad_norm_ each step")
    p.add_argument("--offload", action="store_true", help="CPU offload (a no-op on CPU: said once per process)")
    p.add_argument("--save_model", action="store_true", help="accelerator.save_model at the end (record its dtypes)")
    p.add_argument("--gather16", action="store_true", help="DeepSpeed stage3_gather_16bit_weights_on_model_save")
    p.add_argument("--out", required=True)
    return p


def run(args: argparse.Namespace) -> None:
    from accelerate_c import Accelerator, DeepSpeedPlugin, FullyShardedDataParallelPlugin
    from accelerate_c.utils import GradScalerKwargs
    world = int(os.environ.get("WORLD_SIZE", "1"))
    handlers = []
    if args.face == "fsdp":
        name = {2: "SHARD_GRAD_OP", 3: "FULL_SHARD"}[args.stage]
        plugins = {"fsdp_plugin": FullyShardedDataParallelPlugin(sharding_strategy=name, cpu_offload=args.offload)}
        handlers = [GradScalerKwargs(**json.loads(args.scaler))]
        mp = "fp16"
    else:
        ds = {"train_micro_batch_size_per_gpu": args.global_batch // world, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": args.stage}, "fp16": {"enabled": True, **json.loads(args.fp16)}}
        if args.offload:
            ds["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
        if args.gather16:
            ds["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = True
        plugins = {"deepspeed_plugin": DeepSpeedPlugin(hf_ds_config=ds)}
        mp = None  # from the JSON, as HF
    acc = Accelerator(cpu=True, mixed_precision=mp, kwargs_handlers=handlers, **plugins)
    assert acc.mixed_precision == "fp16", acc.mixed_precision
    if world > 1:
        assert acc.strategy.name == "sharded" and acc.strategy.stage == args.stage, (acc.strategy.name, args.stage)
    n, r = acc.num_processes, acc.process_index
    model = build()
    inject = {int(s) for s in args.inject.split(",") if s}
    current = {"step": -1}
    last = model[2].weight  # its last element lies in the last rank's shard (one unit, padding at the end)

    def hook(g: torch.Tensor) -> torch.Tensor:
        if r == 0 and current["step"] in inject:
            g = g.clone()
            g.view(-1)[-1] = float("inf")
        return g
    last.register_hook(hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model, opt = acc.prepare(model, opt)
    skipped, scales = [], []
    for step in range(args.steps):
        current["step"] = step
        x, y = batch(step, args.global_batch)
        per = args.global_batch // n
        loss = torch.nn.functional.mse_loss(model(x[r * per:(r + 1) * per]), y[r * per:(r + 1) * per])
        acc.backward(loss)
        if args.clip:
            acc.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        opt.zero_grad()
        skipped.append(bool(acc.optimizer_step_was_skipped))
        scales.append(float(acc.scaler.get_scale()))
    state = acc.scaler.state_dict()
    ckpt = os.path.join(args.out, "ckpt")
    acc.save_state(ckpt)
    if hasattr(acc.scaler, "apply_overflow"):  # disturb it, then load it back
        acc.scaler.apply_overflow(False)
    else:
        acc.scaler.update(123.0)
    acc.load_state(ckpt)
    reloaded = acc.scaler.state_dict() == state
    # the fp32 weights on every rank (the sharded engine's gather; one process: the module's own)
    sd = acc.strategy.gather_state_dict(model, rank0_only=False) if n > 1 else acc.unwrap_model(model).state_dict()
    record = {"skipped": skipped, "scales": scales, "state": state, "reloaded": reloaded}
    try:  # HF's rules: what this rank gets (None / a dict / HF's ZeRO-3 error), which save_model writes
        hf_sd = acc.get_state_dict(model)
        record["state_dict"] = None if hf_sd is None else sorted({str(v.dtype) for v in hf_sd.values()})
    except ValueError as e:
        hf_sd, record["state_dict_error"] = None, str(e)
    if args.save_model:  # HF: DeepSpeed's 16-bit weights (ZeRO-3 only with gather16, else an error); FSDP: fp32
        try:
            acc.save_model(model, os.path.join(args.out, "model"))
        except ValueError as e:
            record["save_error"] = str(e)
        else:
            from safetensors.torch import load_file
            saved = load_file(os.path.join(args.out, "model", "model.safetensors"))
            record["saved_dtypes"] = sorted({str(v.dtype) for v in saved.values()})
            record["saved_equal"] = all(torch.equal(saved[k], v.detach().to(saved[k].dtype)) for k, v in sd.items())
            if hf_sd:  # HF's save_model writes get_state_dict's dict: the same tensors, the same dtypes
                record["saved_is_state_dict"] = (saved.keys() == hf_sd.keys() and
                                                 all(torch.equal(saved[k], v) for k, v in hf_sd.items()))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"record{r}.json"), "w") as f:
        json.dump(record, f)
    if acc.is_main_process:
        save_file({k: v.detach().float().contiguous() for k, v in sd.items()},
                  os.path.join(args.out, "weights.safetensors"))
    acc.wait_for_everyone()
    acc.end_training()


def main() -> None:
    torch.set_num_threads(1)
    fold_cases.run(lambda argv: run(parser().parse_args(argv)), sys.argv[1:])  # --cases FILE: fold_cases.py


if __name__ == "__main__":
    main()
