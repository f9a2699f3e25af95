# tests/scripts/pp_zero.py: one rank (of 4) of ZeRO over pipeline stages through the Accelerator (dp_shard=2 x pp=2,
# tests/test_pp_accelerator.py), the user's loop unchanged from DDP, against the one-process loop every rank also runs
# itself on the same global batches. Phases, in order, in one launch (the state reset between them):
#   refused  FSDP FULL_SHARD over stages: the NotImplementedError naming it and what works instead
#   zero1    DeepSpeedPlugin zero_stage=1, gradient_clipping=0.5 (DeepSpeed's clipping over every stage), 1F1B
#   zero2    FSDP SHARD_GRAD_OP, transformer_based_wrap (one unit per decoder layer), ZB-H1, gradient accumulation 2,
#            tied embeddings (a weight on both stages), accelerator.clip_grad_norm_(0.5); save_state to --save with
#            the logical weights and Adam moments as <out>/full.safetensors (rank 0) for tests/scripts/tp_load.py
# Checks in <out>/rank<r>.json, per phase ("ok" or the traceback): losses (1e-5 relative) and final weights
# (get_state_dict: the logical model), the optimizer holding 1-D shard pieces of this stage only, covering the stage
# once over the data-parallel ranks, pipeline_parallel_rank, fp16 overflow on one rank skipping the step everywhere.
# Not for: DDP over stages or tp x pp (pp_accel.py), loading (tp_load.py).
import argparse
import copy
import json
import os
import sys
import traceback

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tp_util import llama_config  # noqa: E402

STEPS, B, S, VOCAB = 4, 4, 16, 128
RESULTS: dict = {}


def record(phase, name, fn):
    try:
        fn()
        RESULTS[f"{phase}.{name}"] = "ok"
    except Exception:
        RESULTS[f"{phase}.{name}"] = traceback.format_exc()


def reset(acc=None, model=None):
    """The next phase's Accelerator on the same process group: this one's engines and channels closed."""
    from accelerate_c.pipeline.holdings import pipeline_of
    from accelerate_c.state import AcceleratorState, GradientState
    if acc is not None:
        acc.strategy.close()
        pipeline_of(model).close()
    dist.barrier()
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    for k in [k for k in os.environ if k.startswith(("FSDP_", "ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED",
                                                     "ACCELERATE_DEEPSPEED_"))]:
        os.environ.pop(k)  # (an Accelerator given a plugin sets these, as HF's does)


def make_model(tied):
    from transformers import LlamaForCausalLM
    torch.manual_seed(0)
    return LlamaForCausalLM(llama_config(num_hidden_layers=4, tie_word_embeddings=tied))


def phase_refused():
    from accelerate_c import Accelerator
    from accelerate_c.utils import FullyShardedDataParallelPlugin, ParallelismConfig

    def _():
        try:
            Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(sharding_strategy="FULL_SHARD"),
                        parallelism_config=ParallelismConfig(dp_shard_size=2, pp_size=2))
        except NotImplementedError as e:
            msg = str(e)
            for part in ("FULL_SHARD", "pipeline stage", "pp_size=2", "SHARD_GRAD_OP", "zero_stage=1",
                         "dp_replicate_size"):
                assert part in msg, (part, msg)
            return
        raise AssertionError("FULL_SHARD over pipeline stages was accepted")
    record("refused", "error", _)


def gather_moments(acc, opt):
    """{name/exp_avg: the logical moment} of every parameter of every stage, on every rank: each rank's shard pieces
    (their range of the logical tensor) sent to all with torch.distributed (the test's own plumbing)."""
    sp = acc.strategy.sharded[0]
    mine = []
    for g in opt.optimizer.param_groups:
        for piece in g["params"]:
            e, _ = sp.slot(piece)
            st = opt.optimizer.state.get(piece)
            for key in ("exp_avg", "exp_avg_sq") if st else ():  # (an empty piece has no state)
                mine.append((f"{e.name}/{key}", tuple(e.shape), e.lo, st[key].clone()))
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    out = {}
    for part in every:
        for name, shape, lo, t in part:
            full = out.setdefault(name, torch.zeros(shape))
            full.view(-1)[lo:lo + t.numel()] = t
    return out


def train(phase, acc, tied, clip, save=None, out_dir=None):
    layout = acc.state.parallel_layout
    dp, dpr, accum = layout.dp_size, layout.dp_rank, acc.gradient_accumulation_steps
    model = make_model(tied)
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    full = torch.randint(0, VOCAB, (STEPS * dp * B, S), generator=torch.Generator().manual_seed(7))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(full), batch_size=B)
    model, opt, loader = acc.prepare(model, opt, loader)
    stage = dict(acc.unwrap_model(model).named_parameters())
    losses, ref_losses = [], []
    for step, (ids,) in enumerate(loader):
        glob = full[step * dp * B:(step + 1) * dp * B]
        parts = [ref(input_ids=glob[r * B:(r + 1) * B], labels=glob[r * B:(r + 1) * B]).loss for r in range(dp)]
        (torch.stack(parts).mean() / accum).backward()
        if (step + 1) % accum == 0:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
            ref_opt.step()
            ref_opt.zero_grad()
        ref_losses.append(parts[dpr].item())
        with acc.accumulate(model):
            out = model(input_ids=ids, labels=ids)
            acc.backward(out.loss)  # the pipeline ran it: a no-op
            if clip and acc.sync_gradients:
                acc.clip_grad_norm_(model.parameters(), 0.5)
            opt.step()
            opt.zero_grad()
        losses.append(out.loss.item())

    def _losses():
        for i, (a, b) in enumerate(zip(losses, ref_losses)):
            assert abs(a - b) <= 1e-5 * abs(b), (i, a, b)
    record(phase, "losses", _losses)

    def _pieces():
        assert acc.pipeline_parallel_rank == layout.pp_rank == acc.process_index // 2, acc.pipeline_parallel_rank
        sp = acc.strategy.sharded[0]
        held = [p for g in opt.optimizer.param_groups for p in g["params"]]
        assert held and all(p.dim() == 1 and sp.slot(p) is not None for p in held), "shard pieces only"
        mine = sum(p.numel() for p in held)
        total = torch.tensor([mine])
        dist.all_reduce(total, group=layout.dim("dp").process_group)
        assert int(total) == sum(p.numel() for p in stage.values()), (int(total), mine)
        assert mine < sum(p.numel() for p in stage.values()), "the optimizer state is sharded"
    record(phase, "pieces", _pieces)

    sd = acc.get_state_dict(model)

    def _weights():
        if acc.strategy.config.face == "fsdp" and acc.process_index != 0:
            assert sd == {}, "FSDP's full state dict is rank 0's only (HF)"
            return
        want = ref.state_dict()
        assert sorted(sd) == sorted(want), sorted(set(sd) ^ set(want))
        for k, v in want.items():
            # Adam turns rounding-level differences of near-zero gradients into up to one lr step (as pp_accel.py)
            torch.testing.assert_close(sd[k], v, rtol=1e-4, atol=2e-3, msg=lambda m: f"weight {k}: {m}")
    record(phase, "weights", _weights)
    if save:
        acc.save_state(save)
        moments = gather_moments(acc, opt)
        if acc.is_main_process:
            from safetensors.torch import save_file
            save_file({**{k: v.contiguous() for k, v in sd.items()}, **moments},
                      os.path.join(out_dir, "full.safetensors"))
    return model, opt, full


def fp16_skip(phase, acc, model, opt, full):
    """A gradient overflow on one rank only (stage 1, data-parallel rank 1): every rank skips the step."""
    def _():
        from accelerate_c.precision import make_precision
        prec = make_precision("fp16", acc.device, {}, fused_kernels=True)
        inner = acc.unwrap_model(model)
        before = {k: p.detach().clone() for k, p in inner.named_parameters()}
        prec.scale_loss(model(input_ids=full[:B], labels=full[:B]).loss)  # (the scaler's scale exists from here)
        if acc.process_index == 3:
            sp = acc.strategy.sharded[0]
            next(g for g in sp.grads if g.numel())[0] = float("inf")
        skipped = acc.strategy.step(opt.optimizer, prec)
        assert skipped is True, skipped
        for k, p in inner.named_parameters():
            assert torch.equal(p.detach(), before[k]), k
        opt.zero_grad()
    record(phase, "fp16_agreed_skip", _)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--save", required=True)
    args = ap.parse_args()
    from accelerate_c import Accelerator
    from accelerate_c.utils import DeepSpeedPlugin, FullyShardedDataParallelPlugin, ParallelismConfig

    phase_refused()
    reset()
    ds = {"train_micro_batch_size_per_gpu": B, "gradient_clipping": 0.5, "zero_optimization": {"stage": 1}}
    acc = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=ds),
                      parallelism_config=ParallelismConfig(dp_shard_size=2, pp_size=2, pp_num_micro_batches=2))
    assert acc.strategy.name == "sharded" and acc.strategy.stage == 1, (acc.strategy.name, acc.strategy.stage)
    model, opt, full = train("zero1", acc, tied=False, clip=False)
    fp16_skip("zero1", acc, model, opt, full)
    reset(acc, model)
    fsdp = FullyShardedDataParallelPlugin(sharding_strategy="SHARD_GRAD_OP", auto_wrap_policy="transformer_based_wrap")
    acc = Accelerator(fsdp_plugin=fsdp, gradient_accumulation_steps=2,
                      parallelism_config=ParallelismConfig(dp_shard_size=2, pp_size=2, pp_schedule="zb_h1",
                                                           pp_num_micro_batches=2))
    assert acc.strategy.name == "sharded" and acc.strategy.stage == 2, (acc.strategy.name, acc.strategy.stage)
    train("zero2", acc, tied=True, clip=True, save=args.save, out_dir=args.out)
    units = [u.name for u in acc.strategy.engines[0].units]
    record("zero2", "units", lambda: None if len(units) == 3 else (_ for _ in ()).throw(AssertionError(units)))
    with open(os.path.join(args.out, f"rank{acc.process_index}.json"), "w") as f:
        json.dump(RESULTS, f)
    acc.end_training()


if __name__ == "__main__":
    main()
