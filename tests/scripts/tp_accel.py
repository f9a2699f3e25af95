# tests/scripts/tp_accel.py: one rank of a training run with tensor parallelism through the Accelerator, as a user
# writes it (tests/test_tp_accelerator.py), against the one-process loop that every rank also runs itself on the same
# global batches (DDP semantics: the mean of the data-parallel ranks' batch losses). Layouts by --mode:
#   tp        ParallelismConfig(tp_size=2)                          2 processes
#   tp_sp     MegatronLMPlugin(tp_degree=2, sequence_parallelism=True, gradient_clipping=0.0)   2 processes
#   dp_tp     ParallelismConfig(dp_replicate_size=2, tp_size=2)     4 processes (our DDP over the TP slices)
#   shard_tp  ParallelismConfig(dp_shard_size=2, tp_size=2) + FSDP FULL_SHARD   4 processes
#   tp_fp8    ParallelismConfig(tp_size=2), mixed_precision="fp8", gradient_accumulation_steps=2 (the reference: the
#             same loop with the model's Linears as FP8Linear, accumulating)   2 processes
# Checks recorded in rank<r>.json ("ok" or the traceback): losses over 8 steps (fp32: 1e-5 relative), the first
# step's logical gradients (rtol 1e-5) and clipped norm, the final logical weights (get_state_dict), fp16 loss scaling
# agreed over the model's ranks (a step skipped everywhere when one rank overflows). With --save DIR: save_state there
# and the logical weights and optimizer moments as full.safetensors (rank 0) for tests/scripts/tp_load.py.
# Not for: the engine's own checks (tp_parity.py), timing.
import argparse
import copy
import json
import os
import sys
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tp_util import llama_config  # noqa: E402

RESULTS: dict = {}
STEPS, B, S = 8, 2, 16


def check(name):
    def deco(fn):
        try:
            fn()
            RESULTS[name] = "ok"
        except Exception:
            RESULTS[name] = traceback.format_exc()
        return fn
    return deco


def data(n_batches, dp):
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, 128, (n_batches * dp * B, S), generator=g)
    return torch.utils.data.TensorDataset(ids)


def close(a, b, what, rtol=1e-5):
    scale = max(b.abs().max().item(), 1e-4)
    torch.testing.assert_close(a.float(), b.float(), rtol=rtol, atol=rtol * scale, msg=lambda m: f"{what}: {m}")


def logical(model, group, attr):
    """{name: the logical tensor} of every parameter's `attr` ("data" or "grad"), slices gathered over `group`."""
    from accelerate_c.tensor_parallel.comm import from_blocks
    out = {}
    for k, p in model.named_parameters():
        t = p.detach() if attr == "data" else p.grad
        spec = getattr(p, "_tp_slice", None)
        if spec is None or t is None:
            out[k] = None if t is None else t.clone()
            continue
        buf = t.new_empty((group.size, *t.shape))
        group.all_gather(buf.view(-1), t.contiguous().view(-1))
        out[k] = from_blocks(buf, spec.dim)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--save", default=None)
    args = ap.parse_args()
    from accelerate_c import Accelerator
    from accelerate_c.utils import FullyShardedDataParallelPlugin, MegatronLMPlugin, ParallelismConfig
    from transformers import LlamaForCausalLM
    kw = {}
    if args.mode == "tp":
        kw["parallelism_config"] = ParallelismConfig(tp_size=2)
    elif args.mode == "tp_fp8":
        kw.update(parallelism_config=ParallelismConfig(tp_size=2), mixed_precision="fp8", gradient_accumulation_steps=2)
    elif args.mode == "tp_sp":
        kw["megatron_lm_plugin"] = MegatronLMPlugin(tp_degree=2, sequence_parallelism=True, gradient_clipping=0.0)
    elif args.mode == "dp_tp":
        kw["parallelism_config"] = ParallelismConfig(dp_replicate_size=2, tp_size=2)
    elif args.mode == "shard_tp":
        kw["parallelism_config"] = ParallelismConfig(dp_shard_size=2, tp_size=2)
        kw["fsdp_plugin"] = FullyShardedDataParallelPlugin(sharding_strategy="FULL_SHARD")
    acc = Accelerator(**kw)
    layout = acc.state.parallel_layout
    dp, dpr = layout.dp_size, layout.dp_rank

    torch.manual_seed(0)
    model = LlamaForCausalLM(llama_config())
    ref = copy.deepcopy(model)
    accum = acc.gradient_accumulation_steps
    if args.mode == "tp_fp8":
        from accelerate_c.precision.fp8 import FP8Config, convert_to_fp8
        convert_to_fp8(ref, FP8Config())
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = torch.utils.data.DataLoader(data(STEPS, dp), batch_size=B)
    model, opt, loader = acc.prepare(model, opt, loader)
    inner = acc.unwrap_model(model)
    tp_group = layout.tp_group
    full = data(STEPS, dp).tensors[0]
    losses, ref_losses = [], []
    first = {}
    for step, (ids,) in enumerate(loader):
        glob = full[step * dp * B:(step + 1) * dp * B]
        assert torch.equal(ids, glob[dpr * B:(dpr + 1) * B]), "the rank's batch is its data-parallel share"
        # the reference: DDP's mean of the data-parallel ranks' mean losses (divided by the accumulation steps, as
        # accelerator.backward does), stepped every `accum` batches
        sync = (step + 1) % accum == 0
        parts = [ref(input_ids=glob[r * B:(r + 1) * B], labels=glob[r * B:(r + 1) * B]).loss for r in range(dp)]
        (torch.stack(parts).mean() / accum).backward()
        if step == 0:
            first["ref_grads"] = {k: p.grad.clone() for k, p in ref.named_parameters()}
        if sync:
            ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
            ref_opt.step()
            ref_opt.zero_grad()
        ref_losses.append(parts[dpr].item())

        with acc.accumulate(model):
            out = model(input_ids=ids, labels=ids)
            acc.backward(out.loss)
            if step == 0 and args.mode != "shard_tp":
                first["grads"] = logical(inner, tp_group, "grad")
            if acc.sync_gradients:
                norm = acc.clip_grad_norm_(model.parameters(), 0.5)
                if step == accum - 1:
                    first["norm"], first["ref_norm"] = float(norm), float(ref_norm)
            opt.step()
            opt.zero_grad()
        losses.append(out.loss.item())

    tol = 1e-3 if args.mode == "tp_fp8" else 1e-5  # fp8: a rounding-level difference can move a value one code

    @check("losses")
    def _():
        for i, (a, b) in enumerate(zip(losses, ref_losses)):
            assert abs(a - b) <= tol * abs(b), (i, a, b)

    @check("first_step")
    def _():
        assert abs(first["norm"] - first["ref_norm"]) <= tol * first["ref_norm"], first
        for k, g in first.get("grads", {}).items():
            close(g, first["ref_grads"][k], f"grad {k}", rtol=tol)

    sd = acc.get_state_dict(model)

    @check("weights")
    def _():
        if args.mode == "shard_tp" and not acc.is_main_process:
            assert sd == {}, "FSDP's full state dict is rank 0's only (HF)"
            return
        want = ref.state_dict()
        assert sorted(sd) == sorted(want), (sorted(sd)[:5], sorted(want)[:5])
        for k, v in want.items():
            assert tuple(sd[k].shape) == tuple(v.shape), (k, sd[k].shape, v.shape)
            if tol < 1e-4:  # Adam turns rounding-level gradient differences of near-zero gradients into <= one lr step
                torch.testing.assert_close(sd[k], v, rtol=1e-4, atol=2e-3, msg=lambda m: f"weight {k}: {m}")
            else:  # fp8: a rounding-level difference can move a value by one code, which Adam then follows: at most
                # 1 % of the elements more than one lr step apart (without the amax agreement: 7 %)
                off = ((sd[k].float() - v.float()).abs() > 1e-2).float().mean().item()
                assert off <= 0.01, f"weight {k}: {off:.1%} of the elements differ by more than one lr step"

    if args.save:
        acc.save_state(args.save)
        if args.mode != "shard_tp":
            moments = {}
            for key in ("exp_avg", "exp_avg_sq"):
                from accelerate_c.tensor_parallel.comm import from_blocks
                for k, p in inner.named_parameters():
                    t = opt.optimizer.state[p][key]
                    spec = getattr(p, "_tp_slice", None)
                    if spec is not None:
                        buf = t.new_empty((tp_group.size, *t.shape))
                        tp_group.all_gather(buf.view(-1), t.contiguous().view(-1))
                        t = from_blocks(buf, spec.dim)
                    moments[f"{k}/{key}"] = t.contiguous()
            if acc.is_main_process:
                from safetensors.torch import save_file
                save_file({**{k: v.contiguous() for k, v in sd.items()}, **moments},
                          os.path.join(args.out, "full.safetensors"))

    if args.mode == "tp":
        @check("fp16_agreed_skip")
        def _():
            # a gradient overflow on one TP rank only: every rank skips the step and halves the scale
            from accelerate_c.precision import make_precision
            prec = make_precision("fp16", acc.device, {}, fused_kernels=True)
            before = {k: p.detach().clone() for k, p in inner.named_parameters()}
            out2 = model(input_ids=full[:B], labels=full[:B])
            prec.scale_loss(out2.loss).backward()
            if layout.tp_rank == 1:
                next(p for p in inner.parameters() if getattr(p, "_tp_slice", None) is not None).grad[0] = float("inf")
            skipped = acc.strategy.step(opt.optimizer, prec)
            assert skipped is True, skipped
            for k, p in inner.named_parameters():
                assert torch.equal(p.detach(), before[k]), k
            opt.zero_grad()

    with open(os.path.join(args.out, f"rank{acc.process_index}.json"), "w") as f:
        json.dump(RESULTS, f)
    acc.end_training()


if __name__ == "__main__":
    main()
