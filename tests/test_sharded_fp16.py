# tests/test_sharded_fp16.py: fp16 loss scaling under the sharded engine and DeepSpeed's fp16 / clipping fields.
#  - Accelerator(mixed_precision="fp16") with an FSDP plugin, and a DeepSpeed JSON "fp16" block, on 2-3 gloo
#    processes (stages 1-3): an inf injected into one element of rank 0's gradient lands, after the
#    reduce-scatter, in one rank's shard only; every rank must skip the same steps and keep the same scale, equal
#    to the one-process run of the same script (tests/scripts/sharded_fp16.py), weights within fp16 tolerance of
#    it, and the scaler state restored by save_state/load_state.
#  - DeepSpeed's scaler rules (hysteresis, consecutive_hysteresis, min_loss_scale, static loss_scale) against
#    sequences derived by hand from DeepSpeed's DynamicLossScaler semantics; bad fp16 fields name the field.
#  - DeepSpeed's gradient_clipping on ONE process: applied in the step, against torch's clip_grad_norm_ loop.
# Not for: the rest of the engine (test_sharded_engine.py).
import json

import pytest
import torch
from safetensors.torch import load_file

# torch's GradScaler: growth every 2 clean steps, backoff on the injected step 2
FSDP_SCALER = ["--scaler", json.dumps({"init_scale": 1024, "growth_interval": 2}), "--inject", "2", "--steps", "6"]
# DeepSpeed: 2**10, window 3, hysteresis 2; overflows at steps 1, 2 and 5
DS_FP16 = ["--fp16", json.dumps({"initial_scale_power": 10, "loss_scale_window": 3, "hysteresis": 2}),
           "--inject", "1,2,5", "--steps", "9"]
# by hand, DeepSpeed's rules: step 1 uses up the hysteresis (no change), step 2 halves, the budget is not restored
# before a growth (consecutive_hysteresis false) so step 5 halves at once; growth when 3 steps since the last overflow
DS_EXPECTED = {"skipped": [False, True, True, False, False, True, False, False, False],
               "scales": [1024.0, 1024.0, 512.0, 512.0, 512.0, 256.0, 256.0, 256.0, 512.0]}

CASES = [  # face, stage, nproc, extra, fused optimizer kernels (else the optimizer's own step under GradScaler)
    ("fsdp", 2, 2, FSDP_SCALER, "1"),
    ("fsdp", 3, 2, FSDP_SCALER + ["--clip", "0.5"], "1"),
    ("ds", 1, 2, DS_FP16 + ["--clip", "0.5"], "1"),
    ("ds", 2, 2, DS_FP16 + ["--clip", "0.5"], "0"),
    ("ds", 3, 3, DS_FP16 + ["--global_batch", "12"], "1"),
]
_REFS: dict = {}


def _records(out, nproc):
    return [json.loads((out / f"record{r}.json").read_text()) for r in range(nproc)]


@pytest.mark.parametrize("face,stage,nproc,extra,fused", CASES,
                         ids=[f"{c[0]}-z{c[1]}-n{c[2]}{'' if c[4] == '1' else '-torchstep'}" for c in CASES])
def test_overflow_skips_the_same_steps_on_every_rank(run, tmp_path, tmp_path_factory, face, stage, nproc, extra,
                                                     fused):
    args = ["--face", face] + extra
    key = tuple(args)
    if key not in _REFS:  # the same script on one process: HF's single-process semantics
        _REFS[key] = tmp_path_factory.mktemp("ref")
        run("sharded_fp16.py", args + ["--out", str(_REFS[key])], nproc=1, timeout=120)
    ref = _REFS[key]
    got = tmp_path / "got"
    run("sharded_fp16.py", args + ["--stage", str(stage), "--out", str(got)], nproc=nproc, launcher="accelerate_c",
        timeout=180, env={"ACCELERATE_C_FUSED_OPTIMIZER": fused})
    want = _records(ref, 1)[0]
    assert want["reloaded"]
    if face == "ds":
        assert {k: want[k] for k in DS_EXPECTED} == DS_EXPECTED
    else:
        assert want["skipped"] == [False, False, True, False, False, False]
        assert want["scales"] == [1024.0, 2048.0, 1024.0, 1024.0, 2048.0, 2048.0]
    for r, rec in enumerate(_records(got, nproc)):
        assert rec["skipped"] == want["skipped"], (r, rec["skipped"], want["skipped"])
        assert rec["scales"] == want["scales"], (r, rec["scales"], want["scales"])
        assert rec["state"] == want["state"], (r, rec["state"], want["state"])
        assert rec["reloaded"], f"rank {r}: load_state did not restore the scaler"
    a, b = load_file(str(ref / "weights.safetensors")), load_file(str(got / "weights.safetensors"))
    assert a.keys() == b.keys()
    for k in a:  # fp16 compute copy and fp16 reduction against one process's fp16 autocast
        assert (a[k] - b[k]).abs().max().item() <= 1e-3, k


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


def _launch_wrap(tmp_path, policy):
    import os
    import sys
    from conftest import SCRIPTS, Job, clean_env, describe_all, finish_all
    out = tmp_path / policy
    flags = ["--cpu", "--use_fsdp", "--fsdp_auto_wrap_policy", "TRANSFORMER_BASED_WRAP"] if policy == "env" else []
    job = Job([sys.executable, "-m", "accelerate_c", "launch", *flags, "--num_processes", "2", "--main_process_port",
               "0", os.path.join(SCRIPTS, "sharded_wrap.py"), "--policy", policy, "--out", str(out)],
              tmp_path / "logs", policy, clean_env())
    (rc, _, _), = finish_all([job], 180)
    assert rc == 0, describe_all([job])
    return [json.loads((out / f"record{r}.json").read_text()) for r in range(2)]


def test_auto_wrap_callable_and_no_split_modules(tmp_path):
    """A policy function (functools.partial(transformer_auto_wrap_policy, ...) or the user's own) and
    --fsdp_auto_wrap_policy TRANSFORMER_BASED_WRAP without class names (model._no_split_modules) give their units,
    and the same losses as one unit."""
    ref = _launch_wrap(tmp_path, "none")
    assert ref[0]["units"] == WRAP_UNITS["none"]
    for policy in ("partial", "user", "env"):
        recs = _launch_wrap(tmp_path, policy)
        for rec in recs:
            assert rec["units"] == WRAP_UNITS[policy], (policy, rec["units"])
            for a, b in zip(rec["losses"], ref[0]["losses"]):
                assert abs(a - b) <= 1e-5, (policy, rec["losses"], ref[0]["losses"])


# -- save_model: what HF writes (its Accelerator.get_state_dict under DeepSpeed / FSDP) ----------------------------
SAVE_CASES = [  # face, stage, nproc, extra, expected dtypes (None: HF's ZeRO-3 error), ranks that get the dict
    # (--offload: CPU offload on a CPU run is a no-op that each process says once, one owner per face)
    ("ds", 2, 2, ["--offload"], ["torch.float16"], (0, 1)),  # ZeRO 1/2: the module's own (fp16) weights, every rank
    ("ds", 3, 2, [], None, ()),                         # ZeRO-3 without the flag: HF raises, writes nothing
    ("ds", 3, 2, ["--gather16"], ["torch.float16"], (0,)),  # ZeRO-3 with it: 16-bit on rank 0, None elsewhere
    ("fsdp", 3, 2, ["--offload"], ["torch.float32"], (0,)),  # FSDP: the full fp32 state dict on rank 0, {} elsewhere
    ("ds", 2, 1, [], ["torch.float16"], (0,)),          # one process under a DeepSpeedPlugin: DeepSpeed's engine too
    ("ds", 3, 1, [], None, ()),
]


@pytest.mark.parametrize("face,stage,nproc,extra,dtypes,keepers", SAVE_CASES,
                         ids=[f"{c[0]}-z{c[1]}-n{c[2]}{''.join(c[3])}" for c in SAVE_CASES])
def test_save_model_dtype_like_hf(run, tmp_path, face, stage, nproc, extra, dtypes, keepers):
    done = run("sharded_fp16.py", ["--face", face, "--stage", str(stage), "--steps", "2", "--save_model", "--out",
                                   str(tmp_path)] + extra, nproc=nproc, launcher="accelerate_c", timeout=180)
    said = [line for line in (done.stdout + done.stderr).splitlines() if "UserWarning" in line and "no-op" in line]
    assert len(said) == (nproc if "--offload" in extra else 0), said
    for r in range(nproc):
        rec = json.loads((tmp_path / f"record{r}.json").read_text())
        if dtypes is None:
            assert "stage3_gather_16bit_weights_on_model_save" in rec.get("save_error", ""), rec
            assert "stage3_gather_16bit_weights_on_model_save" in rec.get("state_dict_error", ""), rec
            assert not (tmp_path / "model").exists() or not any((tmp_path / "model").iterdir())
            continue
        assert rec.get("saved_dtypes") == dtypes and rec["saved_equal"], rec
        # get_state_dict: the dict save_model wrote on the ranks that keep it; {} (FSDP) / None (ZeRO-3) elsewhere
        if r in keepers:
            assert rec["state_dict"] == dtypes and rec["saved_is_state_dict"], rec
        else:
            assert rec["state_dict"] == (None if face == "ds" else []) and "saved_is_state_dict" not in rec, rec


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
