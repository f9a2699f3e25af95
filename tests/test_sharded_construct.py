# tests/test_sharded_construct.py: sharded construction (accelerate_c/sharding/construct.py) on real gloo processes:
# a model built on the meta device (every rank, seeded differently per rank: rank 0's values win; or every rank but
# 0, which holds the real "pretrained" model) prepared under ZeRO 1/2/3 through the FSDP face
# (cpu_ram_efficient_loading) and the DeepSpeed face (zero3_init_flag), on 2 and 3 processes, trains to the same
# losses and weights as the single-process loop on the eager model re-initialised from rank 0's seed
# (materialize.reinitialize): BatchNorm buffers and a frozen layer (bn), tied embeddings and a frozen one (gpt2),
# rotary non-persistent buffers and tied embeddings (llama), an ignored module; one stage-3 case over the
# torch.distributed transport (ACCELERATE_C_COMM=torch) instead of shared memory. The runs reuse
# test_sharded_engine's checks (losses, gathered weights, model_slices and optimizer_layout against the reference,
# bytes per step, model-state bytes). Also: a stage-3 meta model saved by save_model loads in transformers and
# equals the reference; no rank allocates the whole model while preparing (live tensor bytes during prepare,
# tracked op by op: at most one unit and a shard on top of the engine's shards); a module without reset_parameters
# is an error on every rank naming it; NO_SHARD (stage 0) gets the whole model from rank 0; transformers'
# from_pretrained under cpu_ram_efficient_loading (keys missing from the checkpoint: initialised on rank 0, meta on
# the others) trains one step like one process.
# Every case of one process count runs in one launch (tests/fold.py): the training cases, the save, the allocation
# probes and construct_checks.py's edges (evaluation mode, from_pretrained, and last the module without
# reset_parameters, whose ValueError every rank records); the references in one process beside it.
# Not for: materialisation on one process (test_materialize.py) or RSS (benchmarks/sharded_init.py).
import json
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import SCRIPTS
from fold import Case, Group, run_checks, run_group
from test_sharded_engine import _ref_args, add_case, check_cases

sys.path.insert(0, SCRIPTS)
from sharded_train import build  # noqa: E402

CASES = [  # model, face, stage, nproc, extra
    ("bn", "fsdp", 3, 2, ["--meta", "all", "--seed_per_rank", "--construct_flag", "--optim", "sgd"]),
    ("bn", "ds", 2, 3, ["--meta", "rank0_real", "--construct_flag", "--optim", "sgd", "--ignore", "head"]),
    ("gpt2", "ds", 3, 3, ["--meta", "all", "--seed_per_rank", "--construct_flag", "--wrap", "layer"]),
    ("gpt2", "fsdp", 2, 2, ["--meta", "rank0_real", "--construct_flag", "--wrap", "layer"]),
    # over torch.distributed (ACCELERATE_C_COMM=torch): the scatter, and stage 3's refills, which bumped the version
    # counter that the constructed parameters share with their unit buffer (autograd: "modified by an inplace op")
    ("llama", "fsdp", 3, 2, ["--meta", "rank0_real", "--construct_flag", "--wrap", "llayer", "--torch_comm"]),
    ("llama", "ds", 1, 3, ["--meta", "all", "--seed_per_rank", "--construct_flag", "--wrap", "llayer"]),
    ("mlp", "fsdp", 3, 2, ["--meta", "all", "--construct_flag", "--wrap", "size", "--bf16"]),
    ("mlp", "ds", 2, 2, ["--meta", "all", "--seed_per_rank", "--wrap", "size", "--bf16"]),
    ("bn", "fsdp", 0, 2, ["--meta", "all", "--seed_per_rank", "--construct_flag", "--optim", "sgd"]),
]
ALLOC = [(3, 2), (3, 3), (2, 2)]  # stage, nproc: test_no_rank_allocates_the_whole_model's runs
MISSING = ("model.norm.weight", "model.layers.1.mlp.down_proj.weight")


def _id(case: tuple) -> str:
    extra = case[4]
    return f"{case[0]}-{case[1]}-z{case[2]}-n{case[3]}-{extra[extra.index('--meta') + 1]}" + \
        ("-seeds" if "--seed_per_rank" in extra else "") + ("-bf16" if "--bf16" in extra else "") + \
        ("-torchcomm" if "--torch_comm" in extra else "")


@pytest.mark.parametrize("nproc", [2, 3], ids=["n2", "n3"])
def test_sharded_construction_on_ranks(tmp_path, nproc):
    """One launch per process count: test_meta_model_trains_like_one_process's cases (a meta model trains like
    one process), test_no_rank_allocates_the_whole_model's runs and, on 2 processes,
    test_stage3_meta_model_saves_what_transformers_loads, test_evaluation_mode_gets_rank0_whole_model,
    test_from_pretrained_with_cpu_ram_efficient_loading and
    test_module_without_reset_parameters_is_an_error_on_every_rank
    (the checks of each below, each failure named by its case)."""
    group = Group(tmp_path, nproc)
    checks = []
    for c in [c for c in CASES if c[3] == nproc]:
        env = {"ACCELERATE_C_COMM": "torch"} if "--torch_comm" in c[4] else None
        extra = [a for a in c[4] if a != "--torch_comm"]
        checks.append(add_case(group, _id(c), *c[:3], extra, _ref_args, env))
    alloc_args = ["--model", "mlp", "--wrap", "size", "--meta", "all", "--construct_flag", "--steps", "1",
                  "--global_batch", 2 * nproc, "--face", "fsdp", "--track_alloc"]
    allocs = [group.add(Case(f"alloc-z{stage}", alloc_args + ["--stage", stage])) for stage, n in ALLOC if n == nproc]
    if nproc == 2:
        args = ["--model", "gpt2", "--global_batch", "8", "--meta", "all", "--wrap", "layer"]
        save_ref, saved = group.ref(args + ["--emulate", "2"]), tmp_path / "saved"
        group.add(Case("save", args + ["--seed_per_rank", "--construct_flag", "--face", "fsdp", "--stage", "3",
                                       "--save_model", saved]))
        src = _pretrained(tmp_path / "pretrained")
        group.add(Case("pretrained", [str(src), str(tmp_path / "pretrained_out")], kind="pretrained",
                             env={"ACCELERATE_USE_FSDP": "true", "FSDP_CPU_RAM_EFFICIENT_LOADING": "true"}))
        group.add(Case("evalmode", [str(tmp_path / "evalmode")], kind="evalmode"))
        group.add(Case("noinit", [str(tmp_path / "noinit")], kind="noinit"))  # last: prepare raises
    run_group(group, timeout=180 + 60 * len(group.cases))
    check_cases(checks)
    more = [(case.name, _check_alloc, case.out, nproc) for case in allocs]
    if nproc == 2:
        more += [("save", _check_saved, save_ref, saved),
                 ("pretrained", _check_pretrained, src, tmp_path / "pretrained_out"),
                 ("evalmode", _check_evalmode, tmp_path / "evalmode"), ("noinit", _check_noinit, tmp_path / "noinit")]
    run_checks(more)


def test_meta_seeds_differ_so_rank0_values_are_the_proof():
    """The per-rank-seed cases prove rank 0's values win only if the seeds give different models."""
    from accelerate_c.sharding.materialize import materialize_model
    models = []
    for seed in (1, 2):
        with torch.device("meta"):
            m = build("gpt2")
        torch.manual_seed(seed)
        models.append(materialize_model(m).state_dict())
    assert not torch.equal(models[0]["transformer.h.0.attn.c_attn.weight"], models[1]["transformer.h.0.attn.c_attn.weight"])


def _check_saved(ref, saved) -> None:
    """test_stage3_meta_model_saves_what_transformers_loads: a stage-3 meta model's save_model loads in
    transformers (tied head kept) and equals the reference."""
    import transformers
    loaded = transformers.GPT2LMHeadModel.from_pretrained(str(saved))
    assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()
    want = load_file(str(ref / "weights.safetensors"))
    sd = loaded.state_dict()
    for k, v in want.items():
        assert torch.allclose(sd[k].float(), v.float(), atol=1e-5, rtol=0), k


def _check_alloc(got, nproc) -> None:
    """test_no_rank_allocates_the_whole_model: live tensor storages made by ops during prepare (tracked op by op;
    the engine's shared-memory buffers are not made by ops): at most one unit plus a shard, far below the whole
    model of 24 units. Stage 3: rank 0 holds the unit being initialised; the others a shard-sized scratch for what
    rank 0 sends, plus the unit's (never written) full buffer between its creation and its release to zero bytes.
    Stage 2: the full parameters are the shared flat buffer, filled in place."""
    for r in range(nproc):
        a = json.loads((got / f"alloc{r}.json").read_text())
        assert a["whole"] >= 20 * a["max_unit"], a
        assert 0 < a["peak"] <= a["max_unit"] + a["max_unit"] // nproc + 1024, (r, a)


def _check_noinit(out) -> None:
    """test_module_without_reset_parameters_is_an_error_on_every_rank: prepare raises on every rank, naming the
    module; rank 1 learns it from rank 0."""
    errors = [json.loads((out / f"result{r}.json").read_text())["error"] or "" for r in range(2)]
    assert "NoInit ('1')" in errors[0] and "reset_parameters" in errors[0], errors
    assert "sharded construction: rank 0 cannot initialise" in errors[1], errors


def _pretrained(src):
    """A saved tiny Llama lacking MISSING: keys the checkpoint lacks (a new head, say), which transformers
    initialises on rank 0 and leaves on the meta device elsewhere (the ranks > 0 load the rest themselves)."""
    build("llama").save_pretrained(str(src))
    weights = load_file(str(src / "model.safetensors"))
    for k in MISSING:
        del weights[k]
    save_file(weights, str(src / "model.safetensors"), metadata={"format": "pt"})
    return src


def _check_pretrained(src, out) -> None:
    """test_from_pretrained_with_cpu_ram_efficient_loading: transformers loads the weights on rank 0 only (the
    others stay on meta); after prepare and one AdamW step on the same batch everywhere, the loss and the gathered
    weights equal one process's on the loaded model."""
    import transformers
    got = json.loads((out / "result0.json").read_text())
    assert got["meta_before_prepare"] == [0.0, 1.0], got["meta_before_prepare"]
    torch.manual_seed(0)  # as the script's ranks before from_pretrained
    ref = transformers.LlamaForCausalLM.from_pretrained(str(src))
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    ids = torch.arange(16).view(2, 8) % 64
    loss = ref(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    assert abs(loss.item() - got["loss"]) <= 1e-5, (loss.item(), got["loss"])
    inv = ref.model.rotary_emb.inv_freq.tolist()
    assert got["inv_freq"] == [inv, inv]
    gathered = load_file(str(out / "gathered.safetensors"))
    for k, v in ref.state_dict().items():
        assert torch.allclose(gathered[k], v, atol=1e-5, rtol=0), k


def _check_evalmode(out) -> None:
    """test_evaluation_mode_gets_rank0_whole_model: prepare_model(evaluation_mode=True) of a meta model (per-rank
    seeds): the whole model, rank 0's values, on every rank (rank 0 initialises, the others receive)."""
    for r in range(2):
        assert json.loads((out / f"result{r}.json").read_text())["differs"] == [], r
