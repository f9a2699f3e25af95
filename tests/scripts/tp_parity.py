# tests/scripts/tp_parity.py: one rank of the tensor-parallel parity runs (tests/test_tensor_parallel.py), 2 gloo
# processes, tp=2 over accelerate_c's shared-memory group, --sp 0|1. Every rank also runs the unsplit model itself on
# the same batch (the one-process reference). Checks, each recorded as "ok" or its traceback in rank<r>.json:
#   llama_fp32   transformers Llama from a config: loss (1e-5 relative), every logical gradient (gathered slices,
#                rtol 1e-5), 8 AdamW steps on the slices (losses 1e-5 relative), the gathered logical weights
#   llama_eval   no labels / no grad: full logits; labels under no_grad: full logits and the same loss
#   qwen2, mistral, qwen3  one step of the same parity (Qwen2: biased q/k/v; Qwen3: per-head q_norm/k_norm as
#                "replicated_with_grad_allreduce")
#   styles       colwise_rep, rowwise_split_input and rowwise_rep in a small MLP
#   bf16         loss and gradients within bf16 tolerance
#   counts       collectives per layer (a 2-layer minus a 1-layer model) and per step, counts and payload bytes
#   clip         clip_grad_norm_ over the group vs torch's on the reference
#   state        tensor_slices cover every sliced logical tensor once across the group; tp_layout; a universal
#                checkpoint's piece files written from checkpoint_slices load on one process bitwise
#   gpt          (--sp 0) a GPT-2-style nn.Linear model through a user plan (tied LM head, biases, LayerNorm)
#   meta         a meta-device Llama sliced, materialised (only the slices), loaded from the reference: same loss
# Not for: bad input (tests/test_tensor_parallel_unit.py), timing (benchmarks/tp_step.py).
import argparse
import copy
import json
import os
import sys
import traceback

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tp_util import GPT, GPT_PLAN, CountingGroup, llama_config, summarize  # noqa: E402

RESULTS: dict = {}


def check(name):
    def deco(fn):
        try:
            fn()
            RESULTS[name] = "ok"
        except Exception:
            RESULTS[name] = traceback.format_exc()
        return fn
    return deco


def batch(step, b=3, s=16, vocab=128):
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, vocab, (b, s), generator=g)
    labels = ids.clone()
    labels[0, :5] = -100
    return ids, labels


def logical_grads(model, group):
    from accelerate_c.tensor_parallel.comm import from_blocks
    out = {}
    for k, p in model.named_parameters():
        spec = getattr(p, "_tp_slice", None)
        if spec is None or p.grad is None:
            out[k] = p.grad
            continue
        buf = p.grad.new_empty((group.size, *p.grad.shape))
        group.all_gather(buf.view(-1), p.grad.contiguous().view(-1))
        out[k] = from_blocks(buf, spec.dim)
    return out


def blocks_of(model, group, name):
    """Every rank's block of parameter `name` (its values), in rank order."""
    t = dict(model.named_parameters())[name].detach().contiguous()
    buf = t.new_empty((group.size, *t.shape))
    group.all_gather(buf.view(-1), t.view(-1))
    return list(buf)


def assert_close(a, b, what, rtol=1e-5):
    """rtol elementwise, with an absolute slack of rtol x the tensor's largest magnitude (at least 1e-4: a gradient
    that is zero in exact arithmetic, such as a key bias's, is rounding noise on both sides)."""
    scale = max(b.abs().max().item(), 1e-4)
    torch.testing.assert_close(a, b, rtol=rtol, atol=rtol * scale, msg=lambda m: f"{what}: {m}")


def rel(a, b):
    return abs(a - b) / max(abs(b), 1e-12)


def compare_grads(tp, ref, group, rtol=1e-5):
    grads = logical_grads(tp, group)
    for k, p in ref.named_parameters():
        assert_close(grads[k], p.grad, f"grad {k}", rtol)


def make_pair(cls, cfg, group, sp, dtype=torch.float32):
    from accelerate_c.tensor_parallel import apply_tensor_parallel
    torch.manual_seed(0)
    ref = cls(cfg).to(dtype)
    tp = apply_tensor_parallel(copy.deepcopy(ref), group, sequence_parallel=sp)
    return ref, tp


def one_step(ref, tp, group, step=0, vocab=128):
    ids, labels = batch(step, vocab=vocab)
    lr, lt = ref(input_ids=ids, labels=labels).loss, tp(input_ids=ids, labels=labels).loss
    lr.backward()
    lt.backward()
    return lr.item(), lt.item()


def run(args):
    from transformers import (LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM,
                              Qwen3Config, Qwen3ForCausalLM)

    from accelerate_c.comm import get_group
    from accelerate_c.tensor_parallel import clip_grad_norm_, gather_full_state_dict, tensor_slices, tp_layout
    group = get_group(None)
    sp = bool(args.sp)

    @check("llama_fp32")
    def _():
        ref, tp = make_pair(LlamaForCausalLM, llama_config(), group, sp)
        a, b = one_step(ref, tp, group)
        assert rel(b, a) <= 1e-5, (a, b)
        compare_grads(tp, ref, group)
        o_ref, o_tp = torch.optim.AdamW(ref.parameters(), lr=3e-3), torch.optim.AdamW(tp.parameters(), lr=3e-3)
        for step in range(8):
            o_ref.step(), o_tp.step()
            o_ref.zero_grad(), o_tp.zero_grad()
            a, b = one_step(ref, tp, group, step + 1)
            assert rel(b, a) <= 1e-5, (step, a, b)
        full = gather_full_state_dict(tp)
        for k, v in ref.state_dict().items():
            assert_close(full[k], v, f"weight {k}", 1e-3)  # Adam magnifies rounding on near-zero gradients
        shard = tp(**dict(zip(("input_ids", "labels"), batch(0)))).logits
        assert shard.shape[-1] == 64, shard.shape  # training with labels: this rank's vocabulary shard

    @check("llama_eval")
    def _():
        ref, tp = make_pair(LlamaForCausalLM, llama_config(), group, sp)
        ids, labels = batch(3)
        with torch.no_grad():
            assert_close(tp(input_ids=ids).logits, ref(input_ids=ids).logits, "logits")
            o_tp, o_ref = tp(input_ids=ids, labels=labels), ref(input_ids=ids, labels=labels)
        assert_close(o_tp.logits, o_ref.logits, "logits with labels")
        assert rel(o_tp.loss.item(), o_ref.loss.item()) <= 1e-5
        assert_close(tp(input_ids=ids).logits.detach(), ref(input_ids=ids).logits.detach(), "grad-mode logits")

    for name, cls, cfg_cls in (("qwen2", Qwen2ForCausalLM, Qwen2Config), ("mistral", MistralForCausalLM, MistralConfig),
                               ("qwen3", Qwen3ForCausalLM, Qwen3Config)):
        @check(name)
        def _():
            cfg = cfg_cls(**llama_config().to_dict())
            ref, tp = make_pair(cls, cfg, group, sp)
            a, b = one_step(ref, tp, group)
            assert rel(b, a) <= 1e-5, (a, b)
            compare_grads(tp, ref, group)

    @check("styles")
    def _():  # colwise_rep (output gathered) then rowwise_split_input (a replicated input sliced), in an MLP
        from accelerate_c.tensor_parallel import apply_tensor_parallel
        torch.manual_seed(0)
        ref = torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.Tanh(), torch.nn.Linear(40, 24), torch.nn.Tanh(),
                                  torch.nn.Linear(24, 24))
        tp = apply_tensor_parallel(copy.deepcopy(ref), group, plan={"0": "colwise_rep", "2": "rowwise_split_input",
                                                                    "4": "rowwise_rep"})
        x = torch.randn(3, 5, 24, generator=torch.Generator().manual_seed(1))
        a, b = ref(x), tp(x)
        assert_close(b, a, "output")
        a.square().sum().backward()
        b.square().sum().backward()
        compare_grads(tp, ref, group)

    @check("bf16")
    def _():
        ref, tp = make_pair(LlamaForCausalLM, llama_config(), group, sp, torch.bfloat16)
        a, b = one_step(ref, tp, group)
        assert rel(b, a) <= 2e-2, (a, b)
        grads = logical_grads(tp, group)
        for k, p in ref.named_parameters():
            err = (grads[k].float() - p.grad.float()).norm() / p.grad.float().norm().clamp_min(1e-12)
            assert err <= 5e-2, (k, err.item())

    @check("counts")
    def _():
        counted = {}
        for layers in (1, 2):
            cg = CountingGroup(group)
            _, tp = make_pair(LlamaForCausalLM, llama_config(num_hidden_layers=layers), cg, sp)
            ids, labels = batch(0)
            tp(input_ids=ids, labels=labels).loss.backward()
            counted[layers] = cg.take()
        expect_counts(counted, sp)

    @check("clip")
    def _():
        ref, tp = make_pair(LlamaForCausalLM, llama_config(), group, sp)
        one_step(ref, tp, group)
        n_ref = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1)
        n_tp = clip_grad_norm_(tp.parameters(), 0.1, group)
        assert rel(n_tp.item(), n_ref.item()) <= 1e-5, (n_tp, n_ref)
        compare_grads(tp, ref, group)
        inf_ref = torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()], float("inf"))
        from accelerate_c.tensor_parallel import grad_norm
        assert rel(grad_norm(tp.parameters(), group, float("inf")).item(), inf_ref.item()) <= 1e-6

    @check("state")
    def _():
        ref, tp = make_pair(LlamaForCausalLM, llama_config(), group, sp)
        layout = tp_layout(tp)
        assert layout["model.layers.0.self_attn.o_proj.weight"].dim == 1
        assert layout["lm_head.weight"].shape == (128, 64) and "model.norm.weight" not in layout
        mine = [(s.name, s.start, s.numel) for s in tensor_slices(tp)]
        every: list = [None] * group.size
        dist.all_gather_object(every, mine)
        sd = ref.state_dict()
        for name in layout:
            ranges = sorted((s, s + n) for r in every for k, s, n in r if k == name)
            assert ranges[0][0] == 0 and ranges[-1][1] == sd[name].numel(), name
            assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:])), name
        for s in tensor_slices(tp):  # the data is the logical tensor's elements at those offsets
            assert torch.equal(s.data, sd[s.name].reshape(-1)[s.start:s.start + s.numel]), s.name
        roundtrip(tp, ref, args.out, group)

    if not sp:
        @check("gpt")
        def _():
            from accelerate_c.tensor_parallel import apply_tensor_parallel
            torch.manual_seed(0)
            ref = GPT()
            tp = apply_tensor_parallel(copy.deepcopy(ref), group, plan=GPT_PLAN)
            assert tp.h[0].attn.n_head == 2 and tp.lm_head.weight is tp.wte.weight
            o_ref, o_tp = torch.optim.AdamW(ref.parameters(), lr=3e-3), torch.optim.AdamW(tp.parameters(), lr=3e-3)
            for step in range(3):
                ids, labels = batch(step, vocab=96)
                (lr_, a), (lt, b) = ref(ids, labels), tp(ids, labels)
                assert lt.shape[-1] == 96 and rel(b.item(), a.item()) <= 1e-5, (step, a, b)
                a.backward(), b.backward()
                if step == 0:
                    compare_grads(tp, ref, group)
                o_ref.step(), o_tp.step()
                o_ref.zero_grad(), o_tp.zero_grad()

    @check("meta")
    def _():
        from accelerate_c.sharding.materialize import materialize_model
        from accelerate_c.tensor_parallel import apply_tensor_parallel, broadcast_replicated, init_rng
        cfg = llama_config()
        torch.manual_seed(0)
        ref = LlamaForCausalLM(cfg)
        with torch.device("meta"):
            tp = LlamaForCausalLM(cfg)
        apply_tensor_parallel(tp, group, sequence_parallel=sp)
        materialize_model(tp, around_init=init_rng(tp))
        blocks = blocks_of(tp, group, "model.layers.0.mlp.up_proj.weight")
        assert not torch.equal(blocks[0], blocks[1])                # each rank drew its own block
        before = {k: v.clone() for k, v in tp.state_dict().items()}
        broadcast_replicated(tp)                                    # replicated tensors were equal already
        assert all(torch.equal(before[k], v) for k, v in tp.state_dict().items())
        held = sum(p.numel() for p in tp.parameters())
        assert held < 0.55 * sum(p.numel() for p in ref.parameters()), held
        assert torch.equal(tp.model.norm.weight, torch.ones(64))
        assert 0.01 < tp.model.layers[0].mlp.up_proj.weight.std().item() < 0.03  # transformers' init, std 0.02
        sd = ref.state_dict()
        with torch.no_grad():
            for k, spec in tp_layout(tp).items():
                tp.state_dict(keep_vars=True)[k].copy_(sd[k].narrow(spec.dim, spec.start, spec.length))
            for k, t in tp.state_dict(keep_vars=True).items():
                if k not in tp_layout(tp) and "rotary" not in k:
                    t.copy_(sd[k])
        a, b = one_step(ref, tp, group)
        assert rel(b, a) <= 1e-5, (a, b)


def roundtrip(tp, ref, out, group):
    """Every rank writes its checkpoint_slices with the universal checkpoint's piece files; one process then loads
    the logical model from them: bitwise the reference's tensors."""
    from transformers import LlamaForCausalLM

    from accelerate_c.checkpointing.layout import whole_model_slices
    from accelerate_c.checkpointing.pieces import PieceReader, rank_file, read_rank_meta, write_rank_file
    from accelerate_c.checkpointing.universal import check_model, load_model, model_index, model_rank_part
    from accelerate_c.tensor_parallel import checkpoint_slices
    d = os.path.join(out, f"ckpt{int(tp._tp_state.comm.sp)}")
    os.makedirs(d, exist_ok=True)
    rank, world = group.rank, group.size
    write_rank_file(os.path.join(d, rank_file("model", rank, world)),
                    *model_rank_part(checkpoint_slices(tp, rank, world)))
    dist.barrier()
    error = None
    if rank == 0:
        try:
            files = [rank_file("model", r, world) for r in range(world)]
            index = model_index(d, files, [read_rank_meta(os.path.join(d, f)) for f in files])
            torch.manual_seed(1)
            fresh = LlamaForCausalLM(llama_config())
            whole = whole_model_slices(fresh, 0, 1)
            check_model(index, fresh, whole)
            with PieceReader(d, index["tensors"]) as reader:
                load_model(reader, index, fresh, whole)
            for k, v in ref.state_dict().items():
                assert torch.equal(fresh.state_dict()[k], v), k
        except Exception as e:   # the other rank waits at the barrier: fail after it
            error = e
    dist.barrier()
    if error is not None:
        raise error


def expect_counts(counted, sp):
    """Per layer (2 layers minus 1) and per step, against the formulas of docs/parallelism.md."""
    b, s, h, e, n_tok = 3, 16, 64, 4, 3 * 16
    act = b * s * h * e
    one, two = summarize(counted[1]), summarize(counted[2])
    per_layer = {op: [two[op][0] - one.get(op, [0, 0])[0], two[op][1] - one.get(op, [0, 0])[1]] for op in two}
    if not sp:
        assert per_layer == {"all_reduce": [4, 4 * act]}, per_layer
        L = 2
        assert two == {"all_reduce": [4 * L + 4, (4 * L + 2) * act + 3 * n_tok * e]}, two
        backward = [c for c in counted[2] if c[2]]
        assert len(backward) == 2 * L + 1 and all(op == "all_reduce" and nb == act for op, nb, _ in backward)
    else:
        assert per_layer == {"all_gather": [6, 6 * act], "reduce_scatter": [4, 4 * act],
                             "all_reduce": [2, 2 * h * e]}, per_layer
        L = 2
        assert two == {"all_gather": [6 * L + 3, (6 * L + 3) * act], "reduce_scatter": [4 * L + 2, (4 * L + 2) * act],
                       "all_reduce": [2 * L + 3, 3 * n_tok * e + (2 * L + 1) * h * e]}, two


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--sp", type=int, default=0)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    torch.set_num_threads(1)
    import datetime
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank = dist.get_rank()
    try:
        run(args)
    finally:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
            json.dump(RESULTS, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
