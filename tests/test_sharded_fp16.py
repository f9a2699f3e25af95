# tests/test_sharded_fp16.py: fp16 loss scaling under the sharded engine and DeepSpeed's fp16 / clipping fields.
#  - Accelerator(mixed_precision="fp16") with an FSDP plugin, and a DeepSpeed JSON "fp16" block, on 2-3 gloo
#    processes (stages 1-3): an inf injected into one element of rank 0's gradient lands, after the
#    reduce-scatter, in one rank's shard only; every rank must skip the same steps and keep the same scale, equal
#    to the one-process run of the same script (tests/scripts/sharded_fp16.py), weights within fp16 tolerance of
#    it, and the scaler state restored by save_state/load_state.
#  - DeepSpeed's scaler rules (hysteresis, consecutive_hysteresis, min_loss_scale, static loss_scale) against
#    sequences derived by hand from DeepSpeed's DynamicLossScaler semantics; bad fp16 fields name the field.
#  - DeepSpeed's gradient_clipping on ONE process: applied in the step, against torch's clip_grad_norm_ loop.
#  - HF 1.15's save_model / get_state_dict dtypes and ranks under both faces; the FSDP face's auto-wrap policies
#    (a callable, model._no_split_modules) through a real prepare.
# The multi-process runs of a process count share one launch, their one-process references one process (the
# scripts' --cases mode; tests/test_sharded_join.py checks that a folded case ends bitwise where it ends alone).
# Not for: the rest of the engine (test_sharded_engine.py).
import json

import pytest
import torch
from safetensors.torch import load_file

from fold import Case, case_output, check_each, launcher_env, run_folded

# torch's GradScaler: growth every 2 clean steps, backoff on the injected step 2
FSDP_SCALER = ["--scaler", json.dumps({"init_scale": 1024, "growth_interval": 2}), "--inject", "2", "--steps", "6"]
# DeepSpeed: 2**10, window 3, hysteresis 2; overflows at steps 1, 2 and 5
DS_FP16 = ["--fp16", json.dumps({"initial_scale_power": 10, "loss_scale_window": 3, "hysteresis": 2}),
           "--inject", "1,2,5", "--steps", "9"]
# by hand, DeepSpeed's rules: step 1 uses up the hysteresis (no change), step 2 halves, the budget is not restored
# before a growth (consecutive_hysteresis false) so step 5 halves at once; growth when 3 steps since the last overflow
DS_EXPECTED = {"skipped": [False, True, True, False, False, True, False, False, False],
               "scales": [1024.0, 1024.0, 512.0, 512.0, 512.0, 256.0, 256.0, 256.0, 512.0]}

OVERFLOW = [  # face, stage, nproc, extra, fused optimizer kernels (else the optimizer's own step under GradScaler)
    ("fsdp", 2, 2, FSDP_SCALER, "1"),
    ("fsdp", 3, 2, FSDP_SCALER + ["--clip", "0.5"], "1"),
    ("ds", 1, 2, DS_FP16 + ["--clip", "0.5"], "1"),
    ("ds", 2, 2, DS_FP16 + ["--clip", "0.5"], "0"),
    ("ds", 3, 3, DS_FP16 + ["--global_batch", "12"], "1"),
]
OVERFLOW = [Case(f"{f}-z{z}-n{n}{'' if fused == '1' else '-torchstep'}", ["--face", f, "--stage", z] + extra,
                 {"ACCELERATE_C_FUSED_OPTIMIZER": fused}, face=f, nproc=n, ref=tuple(["--face", f] + extra))
            for f, z, n, extra, fused in OVERFLOW]
# -- save_model: what HF writes (its Accelerator.get_state_dict under DeepSpeed / FSDP) ----------------------------
SAVE = [  # face, stage, nproc, extra, expected dtypes (None: HF's ZeRO-3 error), ranks that get the dict
    # (--offload: CPU offload on a CPU run is a no-op that each process says once, one owner per face)
    ("ds", 2, 2, ["--offload"], ["torch.float16"], (0, 1)),  # ZeRO 1/2: the module's own (fp16) weights, every rank
    ("ds", 3, 2, [], None, ()),                         # ZeRO-3 without the flag: HF raises, writes nothing
    ("ds", 3, 2, ["--gather16"], ["torch.float16"], (0,)),  # ZeRO-3 with it: 16-bit on rank 0, None elsewhere
    ("fsdp", 3, 2, ["--offload"], ["torch.float32"], (0,)),  # FSDP: the full fp32 state dict on rank 0, {} elsewhere
    ("ds", 2, 1, [], ["torch.float16"], (0,)),          # one process under a DeepSpeedPlugin: DeepSpeed's engine too
    ("ds", 3, 1, [], None, ()),
]
SAVE = [Case(f"save-{f}-z{z}-n{n}{''.join(extra)}", ["--face", f, "--stage", z, "--steps", "2", "--save_model"] + extra,
             face=f, nproc=n, dtypes=dtypes, keepers=keepers) for f, z, n, extra, dtypes, keepers in SAVE]


def _records(out, nproc):
    return [json.loads((out / f"record{r}.json").read_text()) for r in range(nproc)]


def _check_overflow(c, ref, got):
    want = _records(ref, 1)[0]
    assert want["reloaded"]
    if c.info["face"] == "ds":
        assert {k: want[k] for k in DS_EXPECTED} == DS_EXPECTED
    else:
        assert want["skipped"] == [False, False, True, False, False, False]
        assert want["scales"] == [1024.0, 2048.0, 1024.0, 1024.0, 2048.0, 2048.0]
    for r, rec in enumerate(_records(got, c.info["nproc"])):
        assert rec["skipped"] == want["skipped"], (r, rec["skipped"], want["skipped"])
        assert rec["scales"] == want["scales"], (r, rec["scales"], want["scales"])
        assert rec["state"] == want["state"], (r, rec["state"], want["state"])
        assert rec["reloaded"], f"rank {r}: load_state did not restore the scaler"
    a, b = load_file(str(ref / "weights.safetensors")), load_file(str(got / "weights.safetensors"))
    assert a.keys() == b.keys()
    for k in a:  # fp16 compute copy and fp16 reduction against one process's fp16 autocast
        assert (a[k] - b[k]).abs().max().item() <= 1e-3, k


def _check_save(c, out, output):
    nproc, dtypes, keepers = c.info["nproc"], c.info["dtypes"], c.info["keepers"]
    said = [line for line in output.splitlines() if "UserWarning" in line and "no-op" in line]
    assert len(said) == (nproc if "--offload" in c.args else 0), said
    for r in range(nproc):
        rec = json.loads((out / f"record{r}.json").read_text())
        if dtypes is None:
            assert "stage3_gather_16bit_weights_on_model_save" in rec.get("save_error", ""), rec
            assert "stage3_gather_16bit_weights_on_model_save" in rec.get("state_dict_error", ""), rec
            assert not (out / "model").exists() or not any((out / "model").iterdir())
            continue
        assert rec.get("saved_dtypes") == dtypes and rec["saved_equal"], rec
        # get_state_dict: the dict save_model wrote on the ranks that keep it; {} (FSDP) / None (ZeRO-3) elsewhere
        if r in keepers:
            assert rec["state_dict"] == dtypes and rec["saved_is_state_dict"], rec
        else:
            assert rec["state_dict"] == (None if c.info["face"] == "ds" else []), rec
            assert "saved_is_state_dict" not in rec, rec


def _outputs(done, n):
    return [a + "\n" + b for a, b in zip(case_output(done.stdout, n), case_output(done.stderr, n))]


@pytest.mark.parametrize("nproc", [2, 3], ids=["2ranks", "3ranks"])
def test_overflow_and_save_model_on_n_ranks(tmp_path, nproc):
    """OVERFLOW's cases on `nproc` ranks: every rank skips the same steps and keeps the same scale as the one-process
    run of the same script, weights within fp16 tolerance, the scaler restored by load_state; SAVE's cases on
    `nproc` ranks (and, with the references, on one): HF's save_model / get_state_dict dtypes and ranks. One launch
    and one reference process (every case folded: sharded_fp16.py --cases)."""
    overflow = [c for c in OVERFLOW if c.info["nproc"] == nproc]
    save = [c for c in SAVE if c.info["nproc"] == nproc]
    refs = list(dict.fromkeys(c.info["ref"] for c in overflow))  # the same script on one process (HF's semantics)
    one = [Case(f"ref{i}", args) for i, args in enumerate(refs)] + ([c for c in SAVE if c.info["nproc"] == 1]
                                                                     if nproc == 2 else [])
    done_one, done = [], []
    ref_out = run_folded("sharded_fp16.py", one, tmp_path / "one", per_case_s=30, done=done_one)
    got = run_folded("sharded_fp16.py", overflow + save, tmp_path / "got", nproc=nproc, timeout=180,
                     per_case_s=45, done=done)
    check_each(overflow, lambda c: _check_overflow(c, ref_out[f"ref{refs.index(c.info['ref'])}"], got[c.name]))
    out_one, out = _outputs(done_one[0], len(one)), _outputs(done[0], len(overflow) + len(save))
    check_each(save, lambda c: _check_save(c, got[c.name], out[len(overflow) + save.index(c)]))
    single = one[len(refs):]
    check_each(single, lambda c: _check_save(c, ref_out[c.name], out_one[len(refs) + single.index(c)]))


# -- DeepSpeed's scaler rules, in process --------------------------------------------------------------------
def _run_scaler(block, overflows, steps):
    from accelerate_c.deepspeed.loss_scale import DeepSpeedLossScaler, deepspeed_scaler_args
    s = DeepSpeedLossScaler("cpu", **deepspeed_scaler_args(block))
    out = []
    for i in range(steps):
        s.apply_overflow(i in overflows)
        out.append(s.get_scale())
    return out, s


def test_deepspeed_consecutive_hysteresis():
    # consecutive_hysteresis: a clean step restores the budget, so isolated overflows never halve
    scales, _ = _run_scaler({"initial_scale_power": 4, "loss_scale_window": 100, "hysteresis": 2,
                             "consecutive_hysteresis": True}, {1, 3, 4}, 6)
    assert scales == [16.0, 16.0, 16.0, 16.0, 8.0, 8.0]
    # without it the budget is spent for good until a growth: the second isolated overflow halves
    scales, _ = _run_scaler({"initial_scale_power": 4, "loss_scale_window": 100, "hysteresis": 2}, {1, 3}, 5)
    assert scales == [16.0, 16.0, 16.0, 8.0, 8.0]


def test_deepspeed_minimum_then_error():
    from accelerate_c.deepspeed.loss_scale import DeepSpeedLossScaler, deepspeed_scaler_args
    s = DeepSpeedLossScaler("cpu", **deepspeed_scaler_args({"initial_scale_power": 2, "hysteresis": 1,
                                                            "min_loss_scale": 1.5}))
    s.apply_overflow(True)
    assert s.get_scale() == 2.0
    s.apply_overflow(True)
    assert s.get_scale() == 1.5  # max(2 / 2, min_loss_scale)
    with pytest.raises(RuntimeError, match="min_loss_scale=1.5"):
        s.apply_overflow(True)


def test_deepspeed_static_scale_and_defaults():
    scales, _ = _run_scaler({"loss_scale": 128}, {1}, 4)
    assert scales == [128.0] * 4
    from accelerate_c.deepspeed.loss_scale import deepspeed_scaler_args
    # no dynamic key: DeepSpeed's DynamicLossScaler() constructor defaults; any key: the config defaults
    assert deepspeed_scaler_args({"enabled": True}) == {"static_scale": None, "init_scale": 2.0 ** 32,
                                                        "scale_window": 1000, "hysteresis": 1,
                                                        "consecutive_hysteresis": False, "min_scale": 1.0}
    assert deepspeed_scaler_args({"loss_scale_window": 10})["hysteresis"] == 2
    assert deepspeed_scaler_args({"loss_scale_window": 10})["init_scale"] == 2.0 ** 16


@pytest.mark.parametrize("block,field", [({"hysteresis": 0}, "fp16.hysteresis"),
                                         ({"min_loss_scale": 0}, "fp16.min_loss_scale"),
                                         ({"loss_scale": -1}, "fp16.loss_scale"),
                                         ({"loss_scale_window": "x"}, "fp16.loss_scale_window"),
                                         ({"initial_scale_power": 1.5}, "fp16.initial_scale_power")])
def test_deepspeed_fp16_errors_name_the_field(block, field):
    from accelerate_c.deepspeed.loss_scale import deepspeed_scaler_args
    with pytest.raises(ValueError, match=f"`{field}`"):
        deepspeed_scaler_args(block)


# -- DeepSpeed's gradient_clipping on one process ---------------------------------------------------------------
def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def _data(i):
    g = torch.Generator().manual_seed(i)
    x = torch.randn(4, 6, generator=g)
    return x, x[:, :2] * 3.0


@pytest.mark.parametrize("fused", ["1", "0"])
def test_deepspeed_gradient_clipping_on_one_process(sharding_env, monkeypatch, fused):
    monkeypatch.setenv("ACCELERATE_C_FUSED_OPTIMIZER", fused)
    from accelerate_c import Accelerator, DeepSpeedPlugin
    plugin = DeepSpeedPlugin(hf_ds_config={"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
                                           "gradient_clipping": 0.3, "zero_optimization": {"stage": 2}})
    acc = Accelerator(cpu=True, deepspeed_plugin=plugin)
    assert acc.num_processes == 1 and acc.strategy.config.gradient_clipping == 0.3
    model = _model()
    ref = _model()
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for i in range(3):
        x, y = _data(i)
        acc.backward(torch.nn.functional.mse_loss(model(x), y))
        opt.step()
        opt.zero_grad()
        torch.nn.functional.mse_loss(ref(x), y).backward()
        norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.3)
        assert norm > 0.3  # the clipping does something
        ref_opt.step()
        ref_opt.zero_grad()
    for (k, a), b in zip(acc.unwrap_model(model).state_dict().items(), ref.state_dict().values()):
        assert torch.allclose(a, b, atol=1e-6), k


# -- FSDP auto-wrap settings through a real prepare ---------------------------------------------------------------
WRAP_UNITS = {"none": [""], "partial": ["", "transformer.h.0", "transformer.h.1"],
              "env": ["", "transformer.h.0", "transformer.h.1"],
              "user": [""] + [f"transformer.h.{i}.{m}" for i in (0, 1)
                              for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")]}


def test_auto_wrap_callable_and_no_split_modules(tmp_path):
    """A policy function (functools.partial(transformer_auto_wrap_policy, ...) or the user's own) and
    --fsdp_auto_wrap_policy TRANSFORMER_BASED_WRAP without class names (model._no_split_modules) give their units,
    and the same losses as one unit. One launch (sharded_wrap.py --cases); the "env" case gets the variables the
    launcher gives its ranks for `--cpu --use_fsdp --fsdp_auto_wrap_policy TRANSFORMER_BASED_WRAP`."""
    env = launcher_env(["--cpu", "--use_fsdp", "--fsdp_auto_wrap_policy", "TRANSFORMER_BASED_WRAP"], 2)
    cases = [Case(policy, ["--policy", policy], env if policy == "env" else {})
             for policy in ("none", "partial", "user", "env")]
    outs = run_folded("sharded_wrap.py", cases, tmp_path, nproc=2, timeout=180, per_case_s=45)
    recs = {c.name: [json.loads((outs[c.name] / f"record{r}.json").read_text()) for r in range(2)] for c in cases}
    ref = recs["none"]
    assert ref[0]["units"] == WRAP_UNITS["none"]

    def check(c):
        for rec in recs[c.name]:
            assert rec["units"] == WRAP_UNITS[c.name], (c.name, rec["units"])
            for a, b in zip(rec["losses"], ref[0]["losses"]):
                assert abs(a - b) <= 1e-5, (c.name, rec["losses"], ref[0]["losses"])

    check_each(cases[1:], check)


def test_deepspeed_gradient_accumulation_on_one_process(sharding_env):
    """DeepSpeed's gradient_accumulation_steps replaces the Accelerator's at prepare (HF: a warning) and, inside
    accumulate(), the loss is averaged over the window and stepped once at its end (DeepSpeed's engine: loss / GA,
    step at the boundary): the torch loop on the summed gradients of each window's halves."""
    from accelerate_c import Accelerator, DeepSpeedPlugin
    plugin = DeepSpeedPlugin(hf_ds_config={"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
                                           "zero_optimization": {"stage": 1}})
    acc = Accelerator(cpu=True, deepspeed_plugin=plugin)
    model, ref = _model(), _model()
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert acc.gradient_accumulation_steps == 2
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for i in range(4):
        x, y = _data(i)
        with acc.accumulate(model):
            acc.backward(torch.nn.functional.mse_loss(model(x), y))
            opt.step()
            opt.zero_grad()
        (torch.nn.functional.mse_loss(ref(x), y) / 2).backward()
        if i % 2 == 1:
            ref_opt.step()
            ref_opt.zero_grad()
    for (k, a), b in zip(acc.unwrap_model(model).state_dict().items(), ref.state_dict().values()):
        assert torch.allclose(a, b, atol=1e-6), k
