# tests/scripts/sharded_train.py: training under the sharded engine (ZeRO 1/2/3 through a DeepSpeedPlugin or an
# FSDP plugin) and the single-process reference it is checked against (tests/test_sharded_engine.py).
#   --model bn:   ddp_semantics.py's MLP with BatchNorm buffers, a sometimes-unused, a never-used and a frozen layer
#   --model gpt2: transformers' GPT2LMHeadModel built from a tiny config (tied embedding / head), wpe frozen
#   --model mlp:  a stack of equal Linear layers (many units: the memory and bytes formulas)
#   --model llama: transformers' LlamaForCausalLM from a tiny config (rotary inv_freq buffers, tied embeddings)
# Sharded construction (--meta all | rank0_real): the distributed run builds the model on the meta device (every
# rank, or every rank but 0, which holds the real model), seeded per rank with --seed_per_rank; the reference is
# the eager model re-initialised by materialize.reinitialize from seed 1 (rank 0's seed). --track_alloc writes
# alloc<r>.json: the peak bytes of tensor storages alive during prepare (alloc_track.py).
#   --model bnmp: Linear/BatchNorm layers and nothing replicated (a model every parameter of which has a bf16 compute
#                 copy: BatchNorm under mixed precision, --buffer_bf16)
# --fp8 [--fp8_recipe FORMAT[:delayed[:LEN[:ALGO]]]]: Accelerator(mixed_precision="fp8"): Linear layers become FP8Linear
#   over the engine's bf16 compute copy; the --emulate reference converts the same layers and runs each rank's
#   chunk through a bf16 copy with that rank's own scaling state; --one_process is the Accelerator's own fp8 run
#   on one process (no plugin, fp32 weights). stats<r>.json then lists the fp8 layers, whether their weights view
#   the engine's unit buffers, and each rank's amax histories; --resume_check: save_state, one more step, load_state,
#   the same step again (resume<r>.json: both losses, whether the weights and fp8 amax histories came out the same).
# Mixed precision (--bf16 / --fp16): the reference's compute copy (compute_copy) has every parameter in the compute
# dtype, frozen ones too (FSDP2), but BatchNorm modules in fp32 with their inputs cast to fp32 and their outputs back
# (FSDP1's _module_classes_to_ignore; --bn_low: BatchNorm in the compute dtype too). --fp16: a static loss scale of
# 1024 on both sides (the distributed run records that no step was skipped).
# With --emulate N on one process the same run is computed without communication: per-rank buffers follow DDP's
# broadcast_buffers rule, gradients are the average over ranks, optimizer AdamW or SGD with momentum, clipping
# torch's clip_grad_norm_. Output in --out: losses.json, weights.safetensors, optim.safetensors ("<param>/<key>"),
# and from the distributed run per rank: stats<r>.json (bytes per step, model-state bytes), slices<r>.safetensors
# (model_slices and the optimizer state by optimizer_layout, keyed "<name>@<start>"), statedict<r>.json (what
# accelerator.get_state_dict gave the rank and the peak bytes it allocated; weights.safetensors holds the fp32
# weights of strategy.gather_state_dict, as the DeepSpeed face's get_state_dict is 16-bit under --bf16/--fp16).
# sharded_cases.py runs several of these runs in one process (main(argv); fold_cases.py sequences them).
import argparse
import copy as pycopy
import dataclasses
import json
import os
from typing import Any

import torch
from safetensors.torch import save_file

from ddp_semantics import BNNet, chunk

WRAPS = {"no": ("no_wrap", (), 0), "layer": ("transformer_based_wrap", ("GPT2Block",), 0),
         "size": ("size_based_wrap", (), 1000), "llayer": ("transformer_based_wrap", ("LlamaDecoderLayer",), 0)}


def build(kind: str) -> torch.nn.Module:
    torch.manual_seed(1)
    if kind == "bn":
        return BNNet()
    if kind == "mlp":
        return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(48, 48), torch.nn.Tanh()) for _ in range(24)])
    if kind == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM
        return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                                            tie_word_embeddings=True))
    if kind == "bnmp":
        L, B = torch.nn.Linear, torch.nn.BatchNorm1d
        return torch.nn.Sequential(L(6, 16), B(16), torch.nn.ReLU(), L(16, 16), B(16), torch.nn.Tanh(), L(16, 1))
    from transformers import GPT2Config, GPT2LMHeadModel
    cfg = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(cfg)
    model.transformer.wpe.weight.requires_grad_(False)
    return model


def batch(kind: str, step: int, global_batch: int) -> tuple:
    g = torch.Generator().manual_seed(100 + step)
    if kind in ("bn", "bnmp"):
        x = torch.randn(global_batch, 6, generator=g)
        return x, (x[:, :1] * 2 - x[:, 1:2]).tanh()
    if kind == "mlp":
        x = torch.randn(global_batch, 48, generator=g)
        return x, x.flip(1).sin()
    ids = torch.randint(0, 64, (global_batch, 8), generator=g)
    return ids, ids


def loss_of(kind: str, model: torch.nn.Module, xb: torch.Tensor, yb: torch.Tensor, micro: int) -> torch.Tensor:
    if kind == "bn":
        return torch.nn.functional.mse_loss(model(xb, use_aux=micro % 2 == 0), yb)
    if kind in ("mlp", "bnmp"):
        return torch.nn.functional.mse_loss(model(xb), yb)
    return model(input_ids=xb, labels=yb).loss


def make_optimizers(model: torch.nn.Module, kind: str, two: bool) -> list:
    """One optimizer, or two over halves of the parameters (stepped and zeroed one after the other: the second
    steps after the first zeroed its own gradients)."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not two:
        return [make_optimizer(params, kind)]
    return [make_optimizer(params[:len(params) // 2], kind), make_optimizer(params[len(params) // 2:], kind)]


def make_optimizer(params: list, kind: str) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    # two groups with different hyperparameters: a unit spans both
    decay = [p for p in params if p.dim() >= 2]
    other = [p for p in params if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
                             lr=1e-2, eps=1e-4)  # eps: a zero-mean gradient (attention key bias) stays ~0


def eval_loss(kind: str, model: torch.nn.Module, args: argparse.Namespace = None) -> float:
    """A loss in eval mode under no_grad (stage 3 gathers each unit for it and frees it after); args: the
    reference's compute copy of a mixed-precision run."""
    model.eval()
    with torch.no_grad():
        xb, yb = batch(kind, 999, 4)
        dt = compute_dtype(args) if args is not None else None
        m = compute_copy(model, args) if dt else model
        out = loss_of(kind, m, xb.to(dt) if dt and xb.is_floating_point() else xb, yb, 1).item()
    model.train()
    return out


def compute_dtype(args: argparse.Namespace):
    # fp8: the engine computes on a bf16 copy (mixed_precision fp8 -> param_dtype bf16)
    return torch.bfloat16 if args.bf16 or getattr(args, "fp8", False) else torch.float16 if args.fp16 else None


def compute_copy(model: torch.nn.Module, args: argparse.Namespace) -> torch.nn.Module:
    """The reference's low-precision copy: every parameter in the compute dtype (frozen ones too), buffers only
    under --buffer_bf16; BatchNorm in fp32 (unless --bn_low), its inputs cast to fp32 and its outputs to the
    compute dtype."""
    dt = compute_dtype(args)
    copy = pycopy.deepcopy(model)
    bn = torch.nn.modules.batchnorm._BatchNorm
    bns = set() if args.bn_low else {id(m) for m in copy.modules() if isinstance(m, bn)}
    for m in copy.modules():
        if id(m) in bns:
            m.register_forward_pre_hook(lambda mod, a: tuple(x.float() for x in a))
            m.register_forward_hook(lambda mod, a, out: out.to(dt))
            continue
        for p in m._parameters.values():
            if p is not None:
                p.data = p.data.to(dt)
        for k, b in m._buffers.items():
            if b is not None and b.is_floating_point() and args.buffer_bf16:
                m._buffers[k] = b.to(dt)
    return copy


def optim_state(model: torch.nn.Module, opts: list) -> dict:
    names = {id(p): n for n, p in model.named_parameters()}
    return {f"{names[id(p)]}/{k}": v.detach().clone() for opt in opts for p, st in opt.state.items()
            for k, v in st.items() if isinstance(v, torch.Tensor) and v.numel() == p.numel()}


def reference_model(kind: str, meta: str) -> torch.nn.Module:
    """The eager model; for sharded construction as rank 0 materialises it: re-initialised from seed 1."""
    model = build(kind)
    if meta:
        from accelerate_c.sharding.materialize import reinitialize
        torch.manual_seed(1)
        reinitialize(model)
    return model


def constructed_model(args: argparse.Namespace, rank: int) -> torch.nn.Module:
    """--meta all: every rank builds on the meta device; rank0_real: rank 0 holds the reference's real model."""
    if args.meta == "rank0_real" and rank == 0:
        return reference_model(args.model, args.meta)
    with torch.device("meta"):
        model = build(args.model)
    torch.manual_seed(1 + (rank if args.seed_per_rank else 0))  # rank 0 materialises under seed 1 at prepare
    return model


def emulate(args: argparse.Namespace) -> None:
    n, kind = args.emulate, args.model
    model = reference_model(kind, args.meta)
    model.train()
    per_rank = [{k: v.clone() for k, v in model.named_buffers()} for _ in range(n)]
    scaling = None
    if args.fp8:  # the same conversion; each rank keeps its own scaling state (amax histories)
        from accelerate_c.precision.fp8 import FP8Config, convert_to_fp8
        convert_to_fp8(model, FP8Config.from_handler(fp8_handler(args)))
        scaling = [pycopy.deepcopy(fp8_states(model)) for _ in range(n)]

    def load(r: int) -> None:
        for name, b in model.named_buffers():
            b.copy_(per_rank[r][name])

    opts = make_optimizers(model, args.optim, args.two_opt)
    clip = args.clip or args.ds_clip
    synced_prev, losses = True, []
    for m in range(args.steps * args.grad_accum):
        sync = (m + 1) % args.grad_accum == 0
        if synced_prev:
            for r in range(1, n):
                per_rank[r] = {k: v.clone() for k, v in per_rank[0].items()}
        xb, yb = batch(kind, m, args.global_batch)
        total = 0.0
        for r in range(n):
            load(r)
            if args.bf16 or args.fp16 or args.fp8:  # a compute copy of the fp32 master, its gradients in fp32
                copy, dt = compute_copy(model, args), compute_dtype(args)
                scale = 1024.0 if args.fp16 else 1.0
                if scaling is not None:  # fp8: this rank's own scaling state
                    set_fp8_states(copy, scaling[r])
                x = chunk(xb, r, n)
                loss = loss_of(kind, copy, x.to(dt) if x.is_floating_point() else x, chunk(yb, r, n), m)
                (loss * scale / (args.grad_accum * n)).backward()
                # the buffers (in bf16 under FSDP1 buffer_dtype), per rank as DDP's
                per_rank[r] = {k: v.clone() for k, v in copy.named_buffers()}
                for p, q in zip(model.parameters(), copy.parameters()):
                    if q.grad is not None:
                        g = q.grad.float() / scale
                        p.grad = g if p.grad is None else p.grad + g
                total += loss.item() / n
                continue
            loss = loss_of(kind, model, chunk(xb, r, n), chunk(yb, r, n), m)
            (loss / (args.grad_accum * n)).backward()
            per_rank[r] = {k: v.clone() for k, v in model.named_buffers()}
            total += loss.item() / n
        losses.append(total)
        synced_prev = sync
        if sync:
            if clip:
                torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], clip)
            for opt in opts:
                opt.step()
                opt.zero_grad()
    load(0)
    if scaling is not None:
        set_fp8_states(model, scaling[0])  # (the eval loss below is rank 0's)
    write(args, losses + [eval_loss(kind, model, args)], model.state_dict(), optim_state(model, opts))


def fp8_handler(args: argparse.Namespace) -> Any:
    """--fp8_recipe FORMAT[:delayed[:LEN[:ALGO]]] as HF's FP8RecipeKwargs (None: the defaults)."""
    if not args.fp8_recipe:
        return None
    from accelerate_c import FP8RecipeKwargs
    parts = args.fp8_recipe.split(":")
    return FP8RecipeKwargs(fp8_format=parts[0], use_delayed_scaling=len(parts) > 1 and parts[1] == "delayed",
                           amax_history_len=int(parts[2]) if len(parts) > 2 else None,
                           amax_compute_algo=parts[3] if len(parts) > 3 else None)


def fp8_states(model: torch.nn.Module) -> dict:
    from accelerate_c.precision.fp8 import FP8Linear
    return {n: (m.x_state, m.w_state, m.g_state) for n, m in model.named_modules() if isinstance(m, FP8Linear)}


def set_fp8_states(model: torch.nn.Module, states: dict) -> None:
    for n, m in model.named_modules():
        if n in states:
            m.x_state, m.w_state, m.g_state = states[n]


def fp8_report(acc: Any, model: torch.nn.Module) -> dict:
    """The fp8 layers, whether each one's weight (and bias) views one of the engine's unit buffers, and this
    rank's amax histories (x, w, g)."""
    inner = acc.unwrap_model(model)
    engine = acc.strategy.engines[0]
    # stage 1/2: views of the one flat buffer of every unit; stage 3: the engine's own unit parameters (views of
    # their unit's full buffer while it is gathered, stand-ins between uses: sharding/views.py)
    stage3 = getattr(engine, "flat", None) is None
    owners = set() if stage3 else {engine.flat.untyped_storage()._cdata}
    states = fp8_states(inner)
    views = {}
    for n in states:
        m = inner.get_submodule(n)
        views[n] = [str(m.weight.dtype)] + [(id(p) in engine.index) if stage3 else
                                            p.untyped_storage()._cdata in owners for p in (m.weight, m.bias)
                                            if p is not None]
    hist = {n: [s.history for s in st] for n, st in states.items()}
    return {"fp8_layers": sorted(states), "fp8_views": views, "fp8_history": hist}


def one_process(args: argparse.Namespace) -> None:
    """The Accelerator's own run on one process (no plugin) on the whole global batch: --fp8's reference."""
    from accelerate_c import Accelerator
    handler = fp8_handler(args)
    acc = Accelerator(cpu=True, gradient_accumulation_steps=args.grad_accum,
                      mixed_precision="fp8" if args.fp8 else "no", kwargs_handlers=[handler] if handler else None)
    kind = args.model
    model = build(kind)
    optims = make_optimizers(model, args.optim, args.two_opt)
    model, *opts = acc.prepare(model, *optims)
    losses, _, _ = train(acc, model, opts, args)
    write(args, losses + [eval_loss(kind, model)], acc.unwrap_model(model).state_dict(), {})


def train(acc: Any, model: torch.nn.Module, opts: list, args: argparse.Namespace) -> tuple[list, list, list]:
    """The user's loop over this rank's chunk of each global batch: (the losses averaged over the ranks, the bytes
    moved by each synced step (None without the sharded strategy), whether each synced step was skipped)."""
    n, r, kind = acc.num_processes, acc.process_index, args.model
    losses, per_step, skipped = [], [], []
    for m in range(args.steps * args.grad_accum):
        xb, yb = batch(kind, m, args.global_batch)
        with acc.accumulate(model):
            loss = loss_of(kind, model, chunk(xb, r, n), chunk(yb, r, n), m)
            acc.backward(loss)
            if acc.sync_gradients and args.clip:
                acc.clip_grad_norm_(model.parameters(), args.clip)
            for opt in opts:
                opt.step()
                opt.zero_grad()
        if acc.sync_gradients:
            per_step.append(getattr(acc.strategy, "bytes_last_step", None))
            skipped.append(bool(acc.optimizer_step_was_skipped))
        losses.append(acc.reduce(loss.detach(), reduction="mean").item())
    return losses, per_step, skipped


def distributed(args: argparse.Namespace) -> None:
    from accelerate_c import Accelerator
    from accelerate_c import DeepSpeedPlugin, FullyShardedDataParallelPlugin
    if args.face == "fsdp":
        name = {0: "NO_SHARD", 2: "SHARD_GRAD_OP", 3: "FULL_SHARD"}[args.stage]
        if args.hybrid:
            name = {2: "HYBRID_SHARD_ZERO2", 3: "HYBRID_SHARD"}[args.stage]
        policy = None
        if args.reduce_fp32:  # FSDP2's common mixed precision: bf16 compute, fp32 reduction
            from torch.distributed.fsdp import MixedPrecisionPolicy
            policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if args.reduce_bf16:  # fp32 parameters, gradients reduced (and the shard gradient kept) in bf16
            from torch.distributed.fsdp import MixedPrecisionPolicy
            policy = MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)
        if args.buffer_bf16:  # FSDP1's MixedPrecision (a dict with buffer_dtype)
            policy = {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32 if args.reduce_fp32 else
                      torch.bfloat16, "buffer_dtype": torch.bfloat16}
        plugins = {"fsdp_plugin": FullyShardedDataParallelPlugin(sharding_strategy=name, mixed_precision_policy=policy,
                                                                 cpu_ram_efficient_loading=args.construct_flag)}
    else:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        ds = {"train_micro_batch_size_per_gpu": args.global_batch // world,
              "gradient_accumulation_steps": args.grad_accum, "zero_optimization": {"stage": args.stage}}
        if args.gather16:
            ds["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = True
        if args.ds_clip:
            ds["gradient_clipping"] = args.ds_clip
        if args.bf16:
            ds["bf16"] = {"enabled": True}
        if args.ds_comm:  # DeepSpeed's communication_data_type: the reduce dtype
            ds["communication_data_type"] = args.ds_comm
        if args.fp16:  # a static-looking dynamic scale: 2**10, growth only after 1000 clean steps
            ds["fp16"] = {"enabled": True, "initial_scale_power": 10, "loss_scale_window": 1000}
        # (--fp8: the Accelerator's mixed_precision="fp8" fills DeepSpeed's bf16 block, as HF does)
        plugins = {"deepspeed_plugin": DeepSpeedPlugin(hf_ds_config=ds, zero3_init_flag=args.construct_flag)}
    # bf16 through the DeepSpeed face: the Accelerator's mixed_precision; through the FSDP face: param_dtype
    mp = "bf16" if args.bf16 and args.face == "ds" else "no"
    handlers = []
    if args.fp16:  # the Accelerator's fp16 (both faces): an fp16 compute copy, loss scaling
        mp = "fp16"
        from accelerate_c.utils import GradScalerKwargs
        handlers = [GradScalerKwargs(init_scale=1024.0, growth_interval=1000)]
    if args.fp8:
        mp = "fp8"
        handler = fp8_handler(args)
        handlers += [handler] if handler else []
    acc = Accelerator(cpu=True, gradient_accumulation_steps=args.grad_accum, mixed_precision=mp,
                      kwargs_handlers=handlers or None, **plugins)
    # The wrap policy is set on the engine's config directly (the plugins' auto-wrap fields are mapped by the
    # configuration-faces work); everything else comes from the plugin.
    policy, cls, min_params = WRAPS[args.wrap]
    acc.strategy.config = dataclasses.replace(acc.strategy.config, auto_wrap_policy=policy,
                                              transformer_layer_cls=cls, min_num_params=min_params,
                                              ignored_modules=(args.ignore,) if args.ignore else (),
                                              param_dtype=torch.bfloat16 if args.bf16 and mp == "no" else None,
                                              activation_checkpointing=args.ac,
                                              # FSDP2's reshard_after_forward=False on FULL_SHARD (the FSDP face maps
                                              # a plugin's False to SHARD_GRAD_OP, as `accelerate to-fsdp2` does)
                                              reshard_after_forward=not args.no_reshard)
    if args.bn_low:  # FSDP1's MixedPrecision(_module_classes_to_ignore=()): BatchNorm in the compute dtype too
        acc.strategy.config = dataclasses.replace(acc.strategy.config, fp32_module_classes=())
    if args.reduce_fp32 and args.face == "ds":  # (no DeepSpeed key is mapped to it: the engine's config field)
        acc.strategy.config = dataclasses.replace(acc.strategy.config, reduce_dtype=torch.float32)
    assert acc.strategy.name == "sharded" and acc.strategy.stage == args.stage, (acc.strategy.name, args.stage)
    n, r, kind = acc.num_processes, acc.process_index, args.model
    model = constructed_model(args, r) if args.meta else build(kind)
    optims = make_optimizers(model, args.optim, args.two_opt)
    if args.track_alloc:
        from alloc_track import LiveBytes
        with LiveBytes() as live:
            model, *opts = acc.prepare(model, *optims)
        whole = sum(t.numel() * t.element_size() for t in acc.unwrap_model(model).state_dict().values())
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"alloc{r}.json"), "w") as f:
            json.dump({"peak": live.peak, "whole": whole,
                       "max_unit": 4 * max(u.padded for u in acc.strategy.engines[0].units)}, f)
    else:
        model, *opts = acc.prepare(model, *optims)
    losses, per_step, skipped = train(acc, model, opts, args)
    losses.append(eval_loss(kind, model))
    strategy = acc.strategy
    if args.stage == 0:  # NO_SHARD: our DDP, nothing of the engine's to report
        sd = strategy.gather_state_dict(model)
        statedict_report(args, acc, model, sd)
        if acc.is_main_process:
            write(args, losses, sd, {})
        finish(acc)
        return
    state_bytes = strategy.model_state_bytes(opts)
    engine = strategy.engines[0]
    stats = {"bytes_per_step": per_step, "model_state_bytes": state_bytes,
             "padded": sum(u.padded for u in engine.units), "numel": sum(u.numel for u in engine.units),
             "max_unit_padded": max(u.padded for u in engine.units), "units": len(engine.units),
             "world": n, "calls": engine.comm.calls,
             "buffer_dtypes": {k: str(b.dtype) for k, b in acc.unwrap_model(model).named_buffers()},
             "reduce_dtype": str(engine.rdt), "skipped": skipped,
             "param_dtypes": {k: str(p.dtype) for k, p in acc.unwrap_model(model).named_parameters()}}
    if args.fp8:
        stats.update(fp8_report(acc, model))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"stats{r}.json"), "w") as f:
        json.dump(stats, f)
    slices = {f"{s.name}@{s.start}": s.data.clone() for s in strategy.model_slices(model) if s.owner and s.numel}
    for opt in opts:
        inner = opt.optimizer
        flat = [p for g in inner.param_groups for p in g["params"]]
        for slot in strategy.optimizer_layout(opt, model):
            st = inner.state.get(flat[slot.index], {})
            for k, v in st.items():
                if slot.owner and isinstance(v, torch.Tensor) and v.numel() == slot.numel and slot.numel:
                    slices[f"{slot.name}/{k}@{slot.start}"] = v.detach().reshape(-1).clone()
    save_file(slices, os.path.join(args.out, f"slices{r}.safetensors"))
    # a loader's view: every parameter wiped (stage 3: each unit gathered for user code first), this rank's slices
    # written back, then slices_loaded rebuilds the rest
    held = [(s, s.data.clone()) for s in strategy.model_slices(model)]
    with torch.no_grad():
        for p in acc.unwrap_model(model).parameters():
            p.zero_()
        for s, data in held:
            s.data.zero_()
        for s, data in held:
            s.data.copy_(data)
    strategy.slices_loaded(model)
    # the fp32 weights on rank 0 (collective; the DeepSpeed face's get_state_dict is 16-bit under --bf16/--fp16)
    sd = strategy.gather_state_dict(model)
    statedict_report(args, acc, model, sd)
    if acc.is_main_process:
        write(args, losses, sd, {})
    if args.resume_check:
        resume_check(args, acc, model, opts)
    if args.save_model:  # the HF layout from the shards (checkpointing/model.py), config beside it
        acc.save_model(model, args.save_model)
        if acc.is_main_process and hasattr(acc.unwrap_model(model), "config"):
            acc.unwrap_model(model).config.save_pretrained(args.save_model)
    finish(acc)


def finish(acc: Any) -> None:
    """The end of a run (a case of a folded run before the last keeps the default process group: fold_cases.py)."""
    acc.wait_for_everyone()
    acc.end_training()


def resume_check(args: argparse.Namespace, acc: Any, model: torch.nn.Module, opts: list) -> None:
    """save_state, one more step, load_state, the same step again: both give the same loss and weights (and, fp8,
    the same amax histories after it)."""
    from accelerate_c.precision.fp8 import scaling_state
    ckpt = os.path.join(args.out, "ckpt")
    acc.save_state(ckpt)
    kind, n, r = args.model, acc.num_processes, acc.process_index
    runs = []
    for _ in range(2):
        xb, yb = batch(kind, 500, args.global_batch)
        loss = loss_of(kind, model, chunk(xb, r, n), chunk(yb, r, n), 0)
        acc.backward(loss)
        for opt in opts:
            opt.step()
            opt.zero_grad()
        runs.append((acc.reduce(loss.detach(), reduction="mean").item(),
                     {k: v.detach().clone() for k, v in acc.get_state_dict(model).items()},
                     scaling_state(acc.unwrap_model(model))))
        if len(runs) == 1:
            acc.load_state(ckpt)
    same = all(torch.equal(runs[0][1][k], runs[1][1][k]) for k in runs[0][1])
    with open(os.path.join(args.out, f"resume{r}.json"), "w") as f:
        json.dump({"losses": [runs[0][0], runs[1][0]], "same_weights": same, "same_fp8": runs[0][2] == runs[1][2]}, f)


def statedict_report(args: argparse.Namespace, acc: Any, model: torch.nn.Module, fp32: dict) -> None:
    """statedict<r>.json: what accelerator.get_state_dict gave this rank (None / a dict: its size, dtypes, devices;
    on rank 0 whether it equals the fp32 weights `fp32` cast to its dtype), HF's ValueError if it raised, and the
    peak bytes of the tensors it allocated (alloc_track.py) against one gathered unit."""
    from alloc_track import LiveBytes
    error, got = None, None
    with LiveBytes() as live:
        try:
            got = acc.get_state_dict(model)
        except ValueError as e:
            error = str(e)
    units = acc.strategy.engines[0].units if acc.strategy.engines else []  # (none under NO_SHARD)
    rec = {"face": args.face, "stage": args.stage, "gather16": args.gather16, "error": error,
           "kind": "none" if got is None else "dict", "keys": len(got or {}), "fp32_keys": len(fp32),
           "dtypes": sorted({str(v.dtype) for v in (got or {}).values() if v.is_floating_point()}),
           "devices": sorted({v.device.type for v in (got or {}).values()}), "peak": live.peak,
           "unit_bytes": 4 * max((u.padded for u in units), default=0),
           "padded_bytes": 4 * sum(u.padded for u in units)}
    if got and fp32:
        rec["equal"] = got.keys() == fp32.keys() and all(torch.equal(v, fp32[k].to(v.dtype)) for k, v in got.items())
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"statedict{acc.process_index}.json"), "w") as f:
        json.dump(rec, f)


def write(args: argparse.Namespace, losses: list, sd: dict, optim: dict) -> None:
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "losses.json"), "w") as f:
        json.dump(losses, f)
    out = {k: v.detach().clone().contiguous() for k, v in sd.items()}  # clones: tied weights share storage
    save_file(out, os.path.join(args.out, "weights.safetensors"))
    if optim:
        save_file({k: v.contiguous() for k, v in optim.items()}, os.path.join(args.out, "optim.safetensors"))


def main(argv: "list | None" = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", choices=("bn", "gpt2", "mlp", "llama", "bnmp"), default="bn")
    p.add_argument("--stage", type=int, default=3)
    p.add_argument("--face", choices=("fsdp", "ds"), default="fsdp")
    p.add_argument("--wrap", choices=tuple(WRAPS), default="no")
    p.add_argument("--optim", choices=("adamw", "sgd"), default="adamw")
    p.add_argument("--global_batch", type=int, default=12)
    p.add_argument("--grad_accum", type=int, default=1)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--clip", type=float, default=0.0, help="accelerator.clip_grad_norm_ at each synced step")
    p.add_argument("--ds_clip", type=float, default=0.0, help="DeepSpeedPlugin(gradient_clipping=...)")
    p.add_argument("--bf16", action="store_true", help="param_dtype bf16: a bf16 compute copy, fp32 master shards")
    p.add_argument("--reduce_fp32", action="store_true", help="with --bf16: reduce_dtype float32 (FSDP: the policy)")
    p.add_argument("--reduce_bf16", action="store_true", help="fp32 parameters, reduce_dtype bf16 (FSDP face)")
    p.add_argument("--buffer_bf16", action="store_true", help="with --bf16: FSDP1 MixedPrecision buffer_dtype bf16")
    p.add_argument("--fp16", action="store_true", help="mixed_precision fp16: an fp16 compute copy, loss scale 1024")
    p.add_argument("--bn_low", action="store_true", help="with --bf16: BatchNorm in the compute dtype (not fp32)")
    p.add_argument("--ds_comm", default="", help="DeepSpeed face: communication_data_type (fp32, fp16, bf16)")
    p.add_argument("--two_opt", action="store_true", help="two optimizers over halves of the parameters")
    p.add_argument("--hybrid", action="store_true", help="FSDP HYBRID_SHARD(_ZERO2): shard in a host, replicate across")
    p.add_argument("--no_reshard", action="store_true", help="FSDP reshard_after_forward=False")
    p.add_argument("--ac", action="store_true", help="activation checkpointing per unit")
    p.add_argument("--ignore", default="", help="ignored_modules: a regex of module names")
    p.add_argument("--meta", choices=("", "all", "rank0_real"), default="", help="sharded construction")
    p.add_argument("--seed_per_rank", action="store_true", help="--meta: each rank seeded differently")
    p.add_argument("--construct_flag", action="store_true",
                   help="FSDP cpu_ram_efficient_loading / DeepSpeed zero3_init_flag")
    p.add_argument("--track_alloc", action="store_true", help="alloc<r>.json: peak live tensor bytes in prepare")
    p.add_argument("--gather16", action="store_true", help="DeepSpeed: stage3_gather_16bit_weights_on_model_save")
    p.add_argument("--save_model", default="", help="accelerator.save_model into this directory after training")
    p.add_argument("--fp8", action="store_true", help="Accelerator(mixed_precision='fp8'): FP8Linear layers")
    p.add_argument("--fp8_recipe", default="", help="with --fp8: FORMAT[:delayed[:LEN[:ALGO]]] (FP8RecipeKwargs)")
    p.add_argument("--one_process", action="store_true", help="the Accelerator on one process, no plugin")
    p.add_argument("--resume_check", action="store_true", help="save_state / load_state round trip after training")
    p.add_argument("--emulate", type=int, default=0, help="the single-process reference of N ranks")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    (emulate if args.emulate else one_process if args.one_process else distributed)(args)


if __name__ == "__main__":
    main()
