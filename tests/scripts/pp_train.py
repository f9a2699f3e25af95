# tests/scripts/pp_train.py: the pipeline engine (accelerate_c/pipeline) on N gloo processes against one process on
# the same global batch (tests/test_pipeline_parity.py). Every rank computes the single-process reference itself (the
# models are tiny), then trains the same model under PipelineEngine on a fresh process group per case, and checks:
#   --mode parity: for each case "model:schedule:m[:v]" (model llama | llama_tied | llama8 | gpt2), 8 steps of torch AdamW on
#       each stage's parameters: every rank's loss within 1e-5 relative of the reference's, every held parameter within
#       rtol 1e-5 of the reference's same-named one, with an atol of 1e-5 (1% of one step's update): AdamW turns the
#       rounding-level gradient differences of gradients that are zero but for rounding (GPT-2's key bias: softmax
#       ignores it) into updates of order lr; the eval pipeline's logits and loss equal to the model's;
#   --mode memory: stage 0's peak activation bytes (saved-tensor accounting) under 1F1B and GPipe, written to out;
#       then a tied Llama built on the meta device: what each rank holds, that nothing is left on meta, that the tied
#       embedding / head copies are equal across ranks, one training step's loss;
#   --mode fail: the rank given by --fail_rank raises in its stage's forward of micro-batch 1 on step 1; every rank
#       writes what it raised and how long it took to out/fail<r>.json (the test checks nobody hung).
# --transport auto | torch (the p2p transport). Results: out/result<r>.json.
# Not for: timing (benchmarks/pp_step.py).
import argparse
import datetime
import json
import os
import time

import torch
import torch.distributed as dist

VOCAB, SEQ, BATCH, STEPS = 128, 16, 8, 8


def make_model(kind: str) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    if kind.startswith("llama"):
        cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                          num_hidden_layers=8 if kind == "llama8" else 4,
                          num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=kind == "llama_tied")
        return LlamaForCausalLM(cfg)
    cfg = GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=4, n_head=4, n_positions=SEQ, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(cfg)


def batches(n: int) -> list:
    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(n):
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
        labels = ids.clone()
        labels[torch.rand(BATCH, SEQ, generator=g) < 0.2] = -100  # ignored tokens: the normalisation matters
        out.append({"input_ids": ids, "labels": labels})
    return out


def reference(kind: str, data: list) -> tuple:
    model = make_model(kind)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for b in data:
        loss = model(**b).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, model


def engine(kind: str, sched: str, m: int, v: int, rank: int, size: int, args, **kw):
    from accelerate_c.pipeline import PipelineEngine
    pg = dist.new_group(list(range(size)))
    return PipelineEngine(make_model(kind), rank=rank, size=size, group=pg, schedule=sched, num_micro_batches=m,
                          virtual_stages=v, transport=args.transport, **kw)


def parity_case(case: str, rank: int, size: int, args) -> dict:
    kind, sched, m, *rest = case.split(":")
    m, v = int(m), int(rest[0]) if rest else 1
    data = batches(STEPS)
    ref_losses, ref = reference(kind, data)
    eng = engine(kind, sched, m, v, rank, size, args)
    opt = torch.optim.AdamW(eng.parameters(), lr=1e-3)
    eng.train()
    losses = []
    for b in data:
        losses.append(eng(**b).loss.item())
        opt.step()
        opt.zero_grad()
    for i, (a, r) in enumerate(zip(losses, ref_losses)):
        assert abs(a - r) <= 1e-5 * abs(r), f"{case} rank {rank} step {i}: loss {a} vs single process {r}"
    ref_params = dict(ref.named_parameters(remove_duplicate=False))
    held = dict(eng.module.named_parameters(remove_duplicate=False))
    for name, p in held.items():  # rtol 1e-5, atol 1e-5: 1% of one AdamW step (lr 1e-3), see the header
        torch.testing.assert_close(p.detach(), ref_params[name].detach(), rtol=1e-5, atol=1e-5,
                                   msg=lambda s: f"{case} rank {rank} {name}: {s}")
    eng.eval()
    ref.eval()
    with torch.no_grad():
        out, want = eng(**data[0]), ref(**data[0])
    torch.testing.assert_close(out.logits, want.logits, rtol=1e-5, atol=1e-5)
    assert abs(out.loss.item() - want.loss.item()) <= 1e-5 * want.loss.item(), (out.loss, want.loss)
    eng.close()
    owners = {n: eng.checkpoint_owner(n) for n in ref_params}
    return {"case": case, "losses": losses, "held": sorted(held), "owners": owners}


def memory(rank: int, size: int, args) -> dict:
    out = {}
    data = batches(1)
    for sched in ("1f1b", "gpipe"):
        eng = engine("llama", sched, args.micro_batches, 1, rank, size, args, track_memory=True)
        eng.train()
        eng(**data[0])
        out[sched] = eng.runner.peak_bytes.get(rank, 0)
        eng.close()
    out["meta"] = meta(rank, size, args, data[0])
    return out


def meta(rank: int, size: int, args, batch: dict) -> dict:
    """A tied Llama built on the meta device: pruned, then this rank's tensors materialised; the tied copies equal."""
    from accelerate_c.pipeline import PipelineEngine
    with torch.device("meta"):
        model = make_model("llama_tied")
    pg = dist.new_group(list(range(size)))
    eng = PipelineEngine(model, rank=rank, size=size, group=pg, schedule="1f1b", num_micro_batches=2)
    held = dict(eng.module.named_parameters(remove_duplicate=False))
    tied = held.get("model.embed_tokens.weight", held.get("lm_head.weight")).detach().clone()
    other = tied.clone()
    dist.broadcast(other, src=0, group=pg)
    eng.train()
    loss = eng(**batch).loss.item()
    eng.close()
    return {"held": sorted(held), "meta_left": [n for n, p in held.items() if p.is_meta],
            "tied_equal": bool(torch.equal(tied, other)), "loss": loss}


def fail(rank: int, size: int, args) -> dict:
    eng = engine("llama", "1f1b", 4, 1, rank, size, args)
    eng.train()
    inner = eng.runner.stage_fn

    def boom(s: int, mb: dict, x):
        if rank == args.fail_rank and calls["step"] == 1 and mb is eng_mbs[1]:
            raise ValueError("injected failure in the stage")
        return inner(s, mb, x)

    calls, eng_mbs = {"step": 0}, []
    orig_split = eng._split

    def split(batch):
        mbs, sig = orig_split(batch)
        eng_mbs[:] = mbs
        return mbs, sig

    eng._split, eng.runner.stage_fn = split, boom
    data = batches(2)
    t0 = time.monotonic()
    try:
        for i, b in enumerate(data):
            calls["step"] = i
            eng(**b)
        return {"raised": None, "seconds": time.monotonic() - t0}
    except Exception as e:
        return {"raised": f"{type(e).__name__}: {e}", "seconds": time.monotonic() - t0}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", default="parity")
    p.add_argument("--cases", default="")
    p.add_argument("--out", required=True)
    p.add_argument("--transport", default="auto")
    p.add_argument("--micro_batches", type=int, default=8)
    p.add_argument("--fail_rank", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, size = dist.get_rank(), dist.get_world_size()
    if args.mode == "parity":
        result = [parity_case(c, rank, size, args) for c in args.cases.split(",") if c]
    elif args.mode == "memory":
        result = memory(rank, size, args)
    else:
        result = fail(rank, size, args)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"result{rank}.json"), "w") as fh:
        json.dump(result, fh)
    if args.mode == "fail":
        os._exit(0)  # the pipeline's group is aborted: skip the process group's teardown
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
