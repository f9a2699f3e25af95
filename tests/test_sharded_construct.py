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
# Not for: materialisation on one process (test_materialize.py) or RSS (benchmarks/sharded_init.py).
import json
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import SCRIPTS
from test_sharded_engine import _ref_args, _reference, run_case

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


def _id(case: tuple) -> str:
    extra = case[4]
    return f"{case[0]}-{case[1]}-z{case[2]}-n{case[3]}-{extra[extra.index('--meta') + 1]}" + \
        ("-seeds" if "--seed_per_rank" in extra else "") + ("-bf16" if "--bf16" in extra else "") + \
        ("-torchcomm" if "--torch_comm" in extra else "")


@pytest.mark.parametrize("model,face,stage,nproc,extra", CASES, ids=[_id(c) for c in CASES])
def test_meta_model_trains_like_one_process(run, tmp_path, tmp_path_factory, model, face, stage, nproc, extra):
    env = {"ACCELERATE_C_COMM": "torch"} if "--torch_comm" in extra else None
    extra = [a for a in extra if a != "--torch_comm"]
    run_case(run, tmp_path, tmp_path_factory, model, face, stage, nproc, extra, _ref_args, env=env)


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


def test_stage3_meta_model_saves_what_transformers_loads(run, tmp_path, tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    args = ["--model", "gpt2", "--global_batch", "8", "--meta", "all", "--wrap", "layer"]
    ref = _reference(run, tmp_path_factory, args, 2)
    got, saved = tmp_path / "got", tmp_path / "saved"
    run("sharded_train.py", args + ["--seed_per_rank", "--construct_flag", "--face", "fsdp", "--stage", "3",
                                    "--out", str(got), "--save_model", str(saved)], nproc=2,
        launcher="accelerate_c", timeout=180)
    loaded = transformers.GPT2LMHeadModel.from_pretrained(str(saved))
    assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()
    want = load_file(str(ref / "weights.safetensors"))
    sd = loaded.state_dict()
    for k, v in want.items():
        assert torch.allclose(sd[k].float(), v.float(), atol=1e-5, rtol=0), k


@pytest.mark.parametrize("stage,nproc", [(3, 2), (3, 3), (2, 2)])
def test_no_rank_allocates_the_whole_model(run, tmp_path, stage, nproc):
    """Live tensor storages made by ops during prepare (tracked op by op; the engine's shared-memory buffers are not
    made by ops): at most one unit plus a shard, far below the whole model of 24 units. Stage 3: rank 0 holds the
    unit being initialised; the others a shard-sized scratch for what rank 0 sends, plus the unit's (never
    written) full buffer between its creation and its release to zero bytes. Stage 2: the full parameters are the
    shared flat buffer, filled in place."""
    got = tmp_path / "got"
    run("sharded_train.py", ["--model", "mlp", "--wrap", "size", "--meta", "all", "--construct_flag", "--steps", "1",
                             "--global_batch", str(2 * nproc), "--face", "fsdp", "--stage", str(stage),
                             "--track_alloc", "--out", str(got)], nproc=nproc, launcher="accelerate_c", timeout=180)
    for r in range(nproc):
        a = json.loads((got / f"alloc{r}.json").read_text())
        assert a["whole"] >= 20 * a["max_unit"], a
        assert 0 < a["peak"] <= a["max_unit"] + a["max_unit"] // nproc + 1024, (r, a)


def test_module_without_reset_parameters_is_an_error_on_every_rank(run, tmp_path):
    script = tmp_path / "noinit.py"
    script.write_text(
        "import torch\n"
        "from accelerate_c import Accelerator, FullyShardedDataParallelPlugin\n"
        "class NoInit(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.w = torch.nn.Parameter(torch.zeros(4))\n"
        "acc = Accelerator(cpu=True, fsdp_plugin=FullyShardedDataParallelPlugin(cpu_ram_efficient_loading=True))\n"
        "with torch.device('meta'):\n"
        "    model = torch.nn.Sequential(torch.nn.Linear(4, 4), NoInit())\n"
        "try:\n"
        "    acc.prepare(model)\n"
        "except ValueError as e:\n"
        "    print(f'rank {acc.process_index}: {e}', flush=True)\n"
        "    raise SystemExit(3)\n")
    with pytest.raises(AssertionError) as info:
        run(str(script), [], nproc=2, launcher="accelerate_c", timeout=120)
    text = str(info.value)
    assert "NoInit ('1')" in text and "reset_parameters" in text, text[-3000:]
    assert "rank 1: sharded construction: rank 0 cannot initialise" in text, text[-3000:]


MISSING = ("model.norm.weight", "model.layers.1.mlp.down_proj.weight")


def test_from_pretrained_with_cpu_ram_efficient_loading(run, tmp_path):
    """transformers loads the weights on rank 0 only (the others stay on meta); after prepare and one AdamW step
    on the same batch everywhere, the loss and the gathered weights equal one process's on the loaded model."""
    transformers = pytest.importorskip("transformers")
    src, out = tmp_path / "pretrained", tmp_path / "out"
    build("llama").save_pretrained(str(src))
    # keys the checkpoint lacks (a new head, say): transformers initialises them on rank 0 and leaves them on the
    # meta device elsewhere (the ranks > 0 load the rest themselves)
    weights = load_file(str(src / "model.safetensors"))
    for k in MISSING:
        del weights[k]
    save_file(weights, str(src / "model.safetensors"), metadata={"format": "pt"})
    run("construct_pretrained.py", [str(src), str(out)], nproc=2, launcher="accelerate_c", timeout=180)
    got = json.loads((out / "result.json").read_text())
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


def test_evaluation_mode_gets_rank0_whole_model(run, tmp_path):
    """prepare_model(evaluation_mode=True) of a meta model (per-rank seeds): the whole model, rank 0's values, on
    every rank (rank 0 initialises, the others receive)."""
    script = tmp_path / "evalmode.py"
    script.write_text(
        "import sys, torch\n"
        "from accelerate_c import Accelerator, FullyShardedDataParallelPlugin\n"
        "from accelerate_c.sharding.materialize import materialize_model\n"
        "acc = Accelerator(cpu=True, fsdp_plugin=FullyShardedDataParallelPlugin(cpu_ram_efficient_loading=True))\n"
        "make = lambda: torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.BatchNorm1d(5), torch.nn.Linear(5, 2))\n"
        "with torch.device('meta'):\n"
        "    model, ref = make(), make()\n"
        "torch.manual_seed(1)\n"
        "materialize_model(ref)\n"
        "torch.manual_seed(1 + acc.process_index)\n"
        "model = acc.prepare_model(model, evaluation_mode=True)\n"
        "inner = acc.unwrap_model(model)\n"
        "bad = [k for k, v in ref.state_dict().items() if not torch.equal(v, inner.state_dict()[k])]\n"
        "print(f'rank {acc.process_index} differs: {bad}', flush=True)\n"
        "sys.exit(1 if bad else 0)\n")
    out = run(str(script), [], nproc=2, launcher="accelerate_c", timeout=120)
    assert "rank 0 differs: []" in out.stdout and "rank 1 differs: []" in out.stdout, out.stdout[-2000:]
