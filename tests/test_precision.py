# tests/test_precision.py: mixed precision against references: fp16 loss scaling on the fused kernels vs
# torch's own GradScaler path (same scales, same skipped steps, same weights), fp8 linear layers vs a
# reference computed with torch's casts, delayed scaling, config validation, and the convergence check
# (a small byte-level GPT trained 200 steps in bf16 and fp8 ends within 3 % of fp32).
# Not for: the cast kernels themselves (test_ops_cast.py).
import os
import sys

import pytest
import torch

import accelerate_c
from accelerate_c import Accelerator, FP8RecipeKwargs, GradScalerKwargs
from accelerate_c.state import AcceleratorState, GradientState
from accelerate_c.utils import patch_environment

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(autouse=True)
def fresh_state():
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def _fp16_run(fused: bool, clip: bool):
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    # ACCELERATE_C_FUSED_OPTIMIZER=0: torch's GradScaler path (unscale_ and step), the reference
    with patch_environment(ACCELERATE_C_FUSED_OPTIMIZER="1" if fused else "0"):
        acc = Accelerator(mixed_precision="fp16",
                          kwargs_handlers=[GradScalerKwargs(init_scale=2.0**14, growth_interval=3)])
    assert acc.precision.use_fused is fused
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    # SGD, not Adam: Adam's update is nearly invariant to the gradient's scale, so it would hide a wrong unscale
    opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9, weight_decay=1e-3)
    model, opt = acc.prepare(model, opt)
    trace = []
    gen = torch.Generator().manual_seed(1)
    for step in range(12):
        x = torch.randn(8, 16, generator=gen)
        loss = model(x).pow(2).mean()
        if step in (4, 5):
            loss = loss * 1e30  # overflows fp16 gradients: the step must be skipped and the scale backed off
        acc.backward(loss)
        if clip:
            acc.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
        trace.append((acc.optimizer_step_was_skipped, acc.scaler.get_scale()))
    return trace, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("clip", [False, True])
def test_fp16_fused_matches_torch_gradscaler(clip):
    ours, w_ours = _fp16_run(True, clip)
    ref, w_ref = _fp16_run(False, clip)
    assert ours == ref
    assert [s for s, _ in ours][4:6] == [True, True] and not any(s for s, _ in ours[6:])
    assert ours[3][1] > ours[5][1]  # backed off
    assert ours[-1][1] > ours[6][1]  # grew again after growth_interval clean steps
    for a, b in zip(w_ours, w_ref):
        torch.testing.assert_close(a, b, rtol=1e-7, atol=1e-7)


def test_skipped_step_changes_nothing():
    acc = Accelerator(mixed_precision="fp16")
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, opt = acc.prepare(model, opt)
    before = [p.detach().clone() for p in model.parameters()]
    acc.backward(model(torch.randn(2, 4)).sum() * float("inf"))
    opt.step()
    assert acc.optimizer_step_was_skipped
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert len(opt.state) == 0


def test_fp8_linear_matches_reference():
    from accelerate_c.precision.fp8 import FP8Linear, E4M3, E5M2
    acc = Accelerator(mixed_precision="fp8", kwargs_handlers=[FP8RecipeKwargs(fp8_format="HYBRID")])
    torch.manual_seed(0)
    lin = torch.nn.Linear(32, 16)
    ref_w, ref_b = lin.weight.detach().clone(), lin.bias.detach().clone()
    model = acc.prepare(torch.nn.Sequential(lin))
    assert isinstance(model[0], FP8Linear) and model[0].weight is lin.weight
    x = torch.randn(5, 32, requires_grad=True)
    out = model(x)
    # reference: per-tensor current scaling with torch's own casts
    def q(t, dt):
        s = {E4M3: 448.0, E5M2: 57344.0}[dt] / t.abs().max()
        return (t * s).clamp(-448.0 if dt is E4M3 else -57344.0, 448.0 if dt is E4M3 else 57344.0).to(dt).float() / s
    ref = q(x.detach(), E4M3) @ q(ref_w, E4M3).t() + ref_b
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    g = torch.randn_like(out)
    out.backward(g)
    gq = q(g, E5M2)
    torch.testing.assert_close(x.grad, gq @ q(ref_w, E4M3), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lin.weight.grad, gq.t() @ q(x.detach(), E4M3), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lin.bias.grad, g.sum(0), rtol=1e-6, atol=1e-6)
    # fp8 really quantises: the output differs from the full-precision one
    assert not torch.allclose(out, x.detach() @ ref_w.t() + ref_b, rtol=0, atol=1e-6)


def test_fp8_delayed_scaling_and_filter():
    from accelerate_c.precision.fp8 import FP8Linear
    handler = FP8RecipeKwargs(fp8_format="E4M3", use_delayed_scaling=True, amax_history_len=3,
                              amax_compute_algo="max", module_filter_func=lambda m, name: name != "1")
    acc = Accelerator(mixed_precision="fp8", kwargs_handlers=[handler])
    model = acc.prepare(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)))
    assert isinstance(model[0], FP8Linear) and type(model[1]) is torch.nn.Linear
    amaxes = []
    for i in range(5):
        x = torch.randn(4, 8) * (i + 1)
        amaxes.append(float(x.abs().max()))
        model(x).sum().backward()
    hist = model[0].x_state.history
    assert len(hist) == 3 and hist == pytest.approx(amaxes[-3:])
    assert model[0].g_state.dtype is torch.float8_e4m3fn


@pytest.mark.parametrize("during_eval", [None, True])
def test_fp8_in_eval_mode_follows_the_recipe(monkeypatch, during_eval):
    # HF's Transformer Engine rule: fp8 layers compute in high precision in eval mode unless the recipe's
    # use_autocast_during_eval (or ACCELERATE_FP8_USE_AUTOCAST_DURING_EVAL) says otherwise, and an eval forward
    # records no amax. The field was accepted and ignored (eval forwards quantised and fed the history).
    monkeypatch.delenv("ACCELERATE_FP8_USE_AUTOCAST_DURING_EVAL", raising=False)
    handler = FP8RecipeKwargs(fp8_format="E4M3", use_delayed_scaling=True, use_autocast_during_eval=during_eval)
    acc = Accelerator(mixed_precision="fp8", kwargs_handlers=[handler])
    torch.manual_seed(0)
    model = acc.prepare(torch.nn.Sequential(torch.nn.Linear(32, 16)))
    x = torch.randn(5, 32)
    model(x).sum().backward()  # training mode: quantised, one amax recorded
    full = torch.nn.functional.linear(x, model[0].weight, model[0].bias)
    assert len(model[0].x_state.history) == 1
    model.eval()
    with torch.no_grad():
        out = model(x)
    if during_eval:
        assert not torch.allclose(out, full, rtol=0, atol=1e-6) and len(model[0].x_state.history) == 2
    else:
        assert torch.equal(out, full) and len(model[0].x_state.history) == 1
    model.train()
    assert not torch.allclose(model(x), full, rtol=0, atol=1e-6)
    monkeypatch.setenv("ACCELERATE_FP8_USE_AUTOCAST_DURING_EVAL", "1")  # HF's variable when the field is unset
    from accelerate_c.precision.fp8 import FP8Config
    assert FP8Config.from_handler(FP8RecipeKwargs()).use_autocast_during_eval is True


def test_fp8_config_errors(monkeypatch):
    with pytest.raises(ValueError, match="fp8_format"):
        Accelerator(mixed_precision="fp8", kwargs_handlers=[FP8RecipeKwargs(fp8_format="E5M3")])
    AcceleratorState._reset_state(True)
    monkeypatch.setenv("ACCELERATE_FP8_AMAX_COMPUTE_ALGO", "median")
    with pytest.raises(ValueError, match="amax_compute_algo"):
        Accelerator(mixed_precision="fp8")


def test_bf16_and_fp8_converge_like_fp32():
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    import train_gpt
    torch.set_num_threads(1)
    data = train_gpt.load_corpus(400_000)
    final = {}
    for mp in ("no", "bf16", "fp8"):
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        acc = Accelerator(mixed_precision=mp)
        torch.manual_seed(0)
        model = train_gpt.GPT(block_size=64, n_layer=2, n_head=2, n_embd=64)
        opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
        dl = torch.utils.data.DataLoader(train_gpt.Blocks(data, 64), batch_size=16, shuffle=True,
                                         generator=torch.Generator().manual_seed(0))
        model, opt, dl = acc.prepare(model, opt, dl)
        it, losses = iter(dl), []
        for _ in range(100):  # (bf16 matmuls are ~25x slower than fp32 on a CPU without AVX512-BF16)
            x, y = next(it)
            loss = model(x, y)
            acc.backward(loss)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        final[mp] = sum(losses[-20:]) / 20
    assert final["no"] < 2.7  # it learned something (starts at ln 256 = 5.5; 2.55 after 100 steps)
    for mp in ("bf16", "fp8"):
        assert abs(final[mp] - final["no"]) / final["no"] < 0.03, final


@pytest.mark.parametrize("native", [False, True])
def test_bf16_on_a_cpu_without_native_bf16_warns_once(monkeypatch, native):
    # torch's bf16 matmuls on CPUs without AVX512-BF16/AMX are tens of times slower than fp32: with
    # ACCELERATE_C_CPU_BF16_MATMUL=torch (torch's kernels kept) a bf16 run there is told once, naming the capability;
    # a CPU with them (or fp16, or "no") is not. By default there is nothing to tell: precision/cpu_bf16.py's kernels
    # run instead (test_cpu_bf16.py)
    import warnings

    from accelerate_c.precision import policy
    monkeypatch.setenv("ACCELERATE_C_CPU_BF16_MATMUL", "torch")
    monkeypatch.setattr(policy, "cpu_has_native_bf16", lambda: native)
    monkeypatch.setattr(policy, "_warned_slow_bf16", False)
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        acc = Accelerator(mixed_precision="bf16", cpu=True)
        AcceleratorState._reset_state(True)
        Accelerator(mixed_precision="bf16", cpu=True)  # a second one in the same process: no second warning
        AcceleratorState._reset_state(True)
        Accelerator(mixed_precision="fp16", cpu=True)
    slow = [w for w in got if issubclass(w.category, RuntimeWarning) and "native bf16" in str(w.message)]
    assert acc.precision.mode == "bf16"
    if native:
        assert slow == []
    else:
        assert len(slow) == 1, [str(w.message) for w in got]
        assert "mixed_precision='no'" in str(slow[0].message) and torch.backends.cpu.get_cpu_capability() in str(
            slow[0].message)
        assert slow[0].filename == __file__  # points at the user's Accelerator(...) line


def test_the_native_bf16_check_answers_on_this_host():
    from accelerate_c.precision.policy import cpu_has_native_bf16
    assert cpu_has_native_bf16() == bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
