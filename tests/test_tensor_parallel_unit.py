# tests/test_tensor_parallel_unit.py: the tensor-parallel engine's pieces that need no second process (applying the
# engine never communicates: a group that refuses every collective stands in for the TP group): plan resolution from
# transformers' tp_plan and user patterns; bad input (sizes the group does not divide, patterns matching nothing,
# unknown styles, a sequence the group does not divide) as errors naming the module, pattern, style or sizes, with
# the model left untouched; slicing in place (a Parameter keeps its identity, rank r gets block r); a meta-device model
# gets meta slices that materialise as slices only; the logical layout helpers.
# Not for: numerics against one process (test_tensor_parallel.py runs 2 processes).
import sys

import pytest
import torch
from conftest import SCRIPTS
from torch import nn

sys.path.insert(0, SCRIPTS)
from tp_util import GPT, GPT_PLAN, NoCommGroup, llama_config  # noqa: E402

from accelerate_c.tensor_parallel import apply_tensor_parallel, model_plan, tp_layout  # noqa: E402


def llama(**kw):
    from transformers import LlamaForCausalLM
    torch.manual_seed(0)
    return LlamaForCausalLM(llama_config(**kw))


def test_the_model_plan_is_transformers_tp_plan_with_full_names():
    plan = model_plan(llama())
    assert plan["lm_head"] == "colwise_gather_output" and plan["model.embed_tokens"] == "embedding_rowwise"
    assert plan["model.layers.*.self_attn.k_proj"] == "colwise" and plan["model.layers.*.mlp.down_proj"] == "rowwise"


def test_slices_in_place_and_keeps_parameters():
    model = llama()
    full = {k: v.clone() for k, v in model.state_dict().items()}
    q = model.model.layers[1].self_attn.q_proj.weight
    opt = torch.optim.AdamW(model.parameters())          # built before: must see the slices
    apply_tensor_parallel(model, NoCommGroup(1, 2))
    attn = model.model.layers[1].self_attn
    assert attn.q_proj.weight is q and any(p is q for p in opt.param_groups[0]["params"])
    assert torch.equal(q, full["model.layers.1.self_attn.q_proj.weight"][32:])
    assert torch.equal(attn.o_proj.weight, full["model.layers.1.self_attn.o_proj.weight"][:, 32:])
    assert (attn.q_proj.out_features, attn.k_proj.out_features, attn.o_proj.in_features) == (32, 16, 32)
    emb = model.model.embed_tokens
    assert emb.num_embeddings == 64 and torch.equal(emb.weight, full["model.embed_tokens.weight"][64:])
    assert isinstance(attn.q_proj, nn.Linear) and isinstance(emb, nn.Embedding)
    assert model.config.num_attention_heads == 4 and model.config.vocab_size == 128   # the config stays logical
    layout = tp_layout(model)
    assert layout["model.layers.1.mlp.down_proj.weight"].dim == 1
    assert layout["model.layers.1.mlp.down_proj.weight"].start == 64 and "model.norm.weight" not in layout
    assert sum(p.numel() for p in opt.param_groups[0]["params"]) < 0.55 * sum(v.numel() for v in full.values())


def test_user_plan_divides_attribute_heads_and_keeps_ties():
    model = GPT()
    apply_tensor_parallel(model, NoCommGroup(0, 2), plan=GPT_PLAN)
    assert model.h[0].attn.n_head == 2 and model.lm_head.weight is model.wte.weight
    assert model.wte.weight.shape == (48, 48) and model.h[1].mlp.c_fc.bias.shape == (96,)
    assert model.h[1].mlp.c_proj.bias.shape == (48,)     # a row-parallel bias stays whole


def test_meta_model_gets_meta_slices_that_materialise_as_slices():
    from transformers import LlamaForCausalLM

    from accelerate_c.sharding.materialize import materialize_model
    with torch.device("meta"):
        model = LlamaForCausalLM(llama_config(pad_token_id=100))
    apply_tensor_parallel(model, NoCommGroup(1, 2))
    up = model.model.layers[0].mlp.up_proj.weight
    assert up.is_meta and up.shape == (64, 64)
    assert model.model.embed_tokens.padding_idx == 36       # id 100 is row 36 of rank 1's rows [64, 128)
    materialize_model(model)
    assert model.model.layers[0].mlp.up_proj.weight is up and not up.is_meta and up.shape == (64, 64)
    assert torch.equal(model.model.embed_tokens.weight[36], torch.zeros(64))
    assert not any(p.is_meta for p in model.parameters())


def _materialised_rank(rank, use_init_rng):
    from transformers import LlamaForCausalLM

    from accelerate_c.sharding.materialize import materialize_model
    from accelerate_c.tensor_parallel import init_rng
    with torch.device("meta"):
        model = LlamaForCausalLM(llama_config())
    apply_tensor_parallel(model, NoCommGroup(rank, 2))
    torch.manual_seed(5)
    materialize_model(model, around_init=init_rng(model) if use_init_rng else None)
    return model


def test_init_rng_gives_the_ranks_different_blocks_and_the_same_replicas():
    """From one shared random stream every rank would draw the same block (the logical weight repeating itself);
    init_rng gives each rank's slices their own stream and keeps the shared one for the rest."""
    plain = [_materialised_rank(r, False) for r in (0, 1)]
    w = [m.model.layers[0].self_attn.q_proj.weight for m in plain]
    assert torch.equal(w[0], w[1])
    ours = [_materialised_rank(r, True) for r in (0, 1)]
    w = [m.model.layers[0].self_attn.q_proj.weight for m in ours]
    assert not torch.equal(w[0], w[1]) and 0.015 < torch.cat(w).std().item() < 0.025
    for k, t in ours[0].state_dict().items():
        if "norm" in k:
            assert torch.equal(t, ours[1].state_dict()[k]), k


@pytest.mark.parametrize("kw,size,match", [
    (dict(num_attention_heads=6, num_key_value_heads=2, hidden_size=60), 4, "q_proj' computes 6 heads.*head_dim 10"),
    (dict(num_key_value_heads=2), 4, "k_proj' computes 2 heads"),
    (dict(intermediate_size=130), 4, "gate_proj' \\(colwise\\) has out_features=130"),
    (dict(vocab_size=130), 4, "embed_tokens' \\(vocab_embedding\\) has 130 vocabulary rows"),
])
def test_sizes_the_group_does_not_divide_are_named(kw, size, match):
    model = llama(**kw)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=match):
        apply_tensor_parallel(model, NoCommGroup(0, size))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())   # nothing changed
    assert getattr(model, "_tp_state", None) is None


def test_a_hidden_size_the_group_does_not_divide_is_named():
    with pytest.raises(ValueError, match="module 'h.0.attn.q' \\(colwise\\) has out_features=50, not divisible by "
                                         "the tensor-parallel size 4"):
        apply_tensor_parallel(GPT(d=50, n_head=5), NoCommGroup(0, 4), plan=GPT_PLAN)
    with pytest.raises(ValueError, match="attention module 'h.0.attn' has n_head=5, not divisible"):
        apply_tensor_parallel(GPT(d=50, n_head=5), NoCommGroup(0, 2), plan=GPT_PLAN)


@pytest.mark.parametrize("plan,match", [
    ({"model.layers.*.self_attn.x_proj": "colwise"}, "pattern 'model.layers.\\*.self_attn.x_proj' matches no module"),
    ({"model.layers.*.mlp.up_proj.weight": "colwise"}, "names a parameter"),
    ({"model.layers.*.mlp.up_proj": "columnwise"}, "unknown style 'columnwise' for 'model.layers.\\*.mlp.up_proj'"),
    ({"model.layers.*.input_layernorm": "colwise"}, "colwise needs a plain nn.Linear; module "
                                                    "'model.layers.0.input_layernorm' is LlamaRMSNorm"),
    ({"model.layers.*.mlp.up_proj": "colwise", "model.layers.0.mlp.up_proj": "rowwise"}, "given two styles"),
])
def test_bad_plans_are_named(plan, match):
    with pytest.raises(ValueError, match=match):
        apply_tensor_parallel(llama(), NoCommGroup(0, 2), plan=plan)


def test_sequence_parallel_needs_the_vocab_embedding_and_a_divisible_sequence():
    plan = {k: v for k, v in model_plan(llama()).items() if v != "embedding_rowwise"}
    with pytest.raises(ValueError, match="sequence parallelism needs the input embedding"):
        apply_tensor_parallel(llama(), NoCommGroup(0, 2), plan=plan, sequence_parallel=True)
    model = apply_tensor_parallel(llama(), NoCommGroup(0, 2), sequence_parallel=True)
    with pytest.raises(ValueError, match="sequence length 15 is not divisible by the tensor-parallel size 2"):
        model(input_ids=torch.zeros(2, 15, dtype=torch.long))
    with pytest.raises(ValueError, match="already applied"):
        apply_tensor_parallel(model, NoCommGroup(0, 2))


def test_sequence_parallel_marks_the_residual_norms():
    model = apply_tensor_parallel(llama(), NoCommGroup(0, 2), sequence_parallel=True)
    kinds = model._tp_state.kinds
    norms = sorted(k for k, v in kinds.items() if v == "sequence_parallel")
    assert norms == ["model.layers.0.input_layernorm", "model.layers.0.post_attention_layernorm",
                     "model.layers.1.input_layernorm", "model.layers.1.post_attention_layernorm", "model.norm"]
