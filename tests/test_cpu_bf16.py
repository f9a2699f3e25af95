# test_cpu_bf16.py: bf16 autocast on a CPU without native bf16 matmuls through accelerate_c/precision/cpu_bf16.py:
# every replaced op (matmuls, convolutions, scaled_dot_product_attention) against torch's own kernels
# (scripts/cpu_bf16_ops.py, in a process of its own: the replacement is process-wide) and against the float64 result
# of its bf16-rounded inputs; fp16 autocast keeps torch's rule; the tensors saved for backward are the bf16 ones (no
# fp32 copy of an input outlives the forward, for a linear and for attention); torch.compile (aot_eager) traces the
# kernels, and in graphs inductor compiles they keep eager's bits (scripts/cpu_bf16_inductor.py) by rounding in
# integer arithmetic, which equals torch's cast; Accelerator(mixed_precision="bf16") installs them where the CPU
# lacks native bf16, and the setting ACCELERATE_C_CPU_BF16_MATMUL=torch keeps torch's (with its warning).
# Not for: speed (benchmarks/trainer_step.py) or the bf16 precision policy (test_precision.py).
import gc
import json
import subprocess
import sys
import weakref

import pytest
import torch
from conftest import clean_env

from accelerate_c.precision import cpu_bf16, policy

MATMULS = ("linear", "linear_nobias", "mm", "addmm", "bmm", "baddbmm", "matmul_1d2d", "matmul_3d2d")
CONVS = ("conv1d", "conv1d_same", "conv2d", "conv2d_same", "conv3d")
# torch's bf16 kernels round intermediate sums to bf16 on a CPU without native bf16 (addbmm's batch sum, transposed
# convolutions'): ours rounds once, so it is the exactly rounded result and torch's is not
ROUNDS_ONCE = ("addbmm", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d")
# attention: torch's bf16 kernel rounds the softmax probabilities to bf16 before P @ V (not with a float mask, where
# it computes in fp32 as ours does); ours keeps them in fp32
ATTENTION = ("sdpa_causal", "sdpa_float_mask", "sdpa_bool_mask", "sdpa_gqa")


def test_each_op_against_torchs_kernels_and_the_exact_result(run, tmp_path):
    out = tmp_path / "ops.json"
    run("cpu_bf16_ops.py", [str(out)], timeout=240)
    r = json.loads(out.read_text())
    assert r["installed"]
    assert set(r["ops"]) == set(MATMULS + CONVS + ROUNDS_ONCE + ATTENTION)
    for name, o in r["ops"].items():
        assert o["dtype"] == ["torch.bfloat16"] * 2 and o["shape"][0] == o["shape"][1], (name, o)
        assert o["grad_dtypes"][0] == o["grad_dtypes"][1], (name, o)
        assert o["ulps_vs_exact"] <= 1, (name, o)  # fp32 sums of exact products, rounded once
        assert o["fp16_same"], (name, o)  # other autocast dtypes: torch's rule, torch's bits
        if name in MATMULS + CONVS:  # torch's result up to the order of the fp32 sums
            assert o["ulps_vs_torch"] <= 1 and o["differ_frac"] <= 0.01, (name, o)
        elif name == "sdpa_float_mask":
            assert o["differ_frac"] == 0, (name, o)
        else:  # where these differ from torch's, torch's are not exact (on a CPU with native bf16 matmuls, where
            # torch's transposed convolutions round once too, they are the same bits)
            assert o["ulps_vs_torch"] == 0 or o["torch_ulps_vs_exact"] > 1, (name, o)
        # gradients: the matmuls' equal torch's; convolution and attention backward are rounded once here (torch's
        # are ~0.3 % off)
        assert o["grad_rel"] <= (1e-6 if name in MATMULS else 1e-2), (name, o)


def _linear(x, w, b):
    return torch.nn.functional.linear(x, w, b)


def _attention(q, k, v):
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


@pytest.mark.parametrize("op, shapes", [(_linear, ((64, 96), (48, 96), (48,))),
                                        (_attention, ((2, 4, 32, 16),) * 3)], ids=["linear", "attention"])
def test_saved_tensors_are_the_bf16_inputs(monkeypatch, op, shapes):
    """No fp32 copy of an input outlives the forward (autocast's activation memory), and backward gives the bits it
    gives when the fp32 copies are kept."""
    cpu_bf16.install()
    g = torch.Generator().manual_seed(1)
    inputs0 = [torch.randn(*s, generator=g) for s in shapes]
    widened = []
    real_round = cpu_bf16._Rounded.round

    def spy(self, t):
        out = real_round(self, t)
        if out is not t:
            widened.append(weakref.ref(out))
        return out

    monkeypatch.setattr(cpu_bf16._Rounded, "round", spy)
    grads = []
    for track in (True, False):
        monkeypatch.setattr(cpu_bf16, "_plain", lambda t, track=track: track)
        widened.clear()
        inputs = [t.clone().requires_grad_(True) for t in inputs0]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = op(*inputs)
        gc.collect()
        alive = [r for r in widened if r() is not None]
        assert len(widened) == 3 and y.dtype == torch.bfloat16
        # untracked: the inputs the op saves stay alive in fp32 (linear: x and w; attention: q, k and v)
        assert (alive == []) if track else len(alive) == (2 if op is _linear else 3), (track, len(alive))
        y.float().square().sum().backward()
        grads.append([t.grad for t in inputs])
    for a, c in zip(*grads):
        assert torch.equal(a, c)


def test_inputs_autocast_leaves_alone_keep_their_dtype():
    """autocast casts only floating tensors that are not float64: integer and float64 ops keep their dtype"""
    cpu_bf16.install()
    a, b = torch.arange(6).reshape(2, 3), torch.arange(6).reshape(3, 2)
    d, e = a.double(), b.double()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ints, doubles = torch.mm(a, b), torch.matmul(d, e)
    assert ints.dtype == torch.int64 and doubles.dtype == torch.float64
    assert torch.equal(ints, a @ b) and torch.equal(doubles, d @ e)


def test_torch_compile_traces_the_kernels():
    cpu_bf16.install()
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))
    x = torch.randn(16, 32)
    outs = []
    for f in (m, torch.compile(m, backend="aot_eager")):
        m.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = f(x)
        y.float().sum().backward()
        outs.append((y, [p.grad.clone() for p in m.parameters()]))
    (ya, ga), (yb, gb) = outs
    assert ya.dtype == yb.dtype == torch.bfloat16 and torch.equal(ya, yb)
    assert all(torch.equal(a, b) for a, b in zip(ga, gb))


def test_inductor_keeps_the_roundings(run, tmp_path):
    """inductor folds a `.to(bf16).to(fp32)` round trip away: the kernels round by integer arithmetic in compiled
    graphs, so a compiled model of replaced ops gives eager's bits (before: 59 % of the outputs differed)"""
    out = tmp_path / "inductor.json"
    run("cpu_bf16_inductor.py", [str(out)], timeout=300)
    r = json.loads(out.read_text())
    assert r["inside_train"] == {"dtype": "torch.bfloat16", "out_equal": True, "differ": 0.0, "grads_equal": True}, r


def test_round_bits_is_torchs_cast():
    g = torch.Generator().manual_seed(3)
    bits = torch.randint(-2**31, 2**31, (1 << 18,), generator=g, dtype=torch.int64).to(torch.int32)
    specials = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 3.4028235e38, -3.4028235e38,
                             3.3961776e38, 1e-45, -1e-45, 1.1754942e-38, 1.0 + 2**-8, 1.0 + 3 * 2**-8])
    x = torch.cat([bits.view(torch.float32), specials, torch.randn(1 << 16, generator=g)])
    ours, torchs = cpu_bf16._round_bits(x), x.to(torch.bfloat16).float()
    assert torch.equal(torch.isnan(ours), torch.isnan(torchs))
    assert torch.equal(ours[~torch.isnan(ours)], torchs[~torch.isnan(torchs)])


@pytest.mark.skipif(policy.cpu_has_native_bf16(), reason="this CPU has native bf16 matmuls: nothing is replaced")
@pytest.mark.parametrize("setting", [None, "torch"])
def test_the_accelerator_installs_them_unless_told_not_to(setting):
    code = ("import warnings; warnings.simplefilter('always')\n"
            "from accelerate_c import Accelerator\nfrom accelerate_c.precision import cpu_bf16\n"
            "with warnings.catch_warnings(record=True) as w:\n"
            "    warnings.simplefilter('always')\n"
            "    Accelerator(mixed_precision='bf16', cpu=True)\n"
            "print(cpu_bf16.installed(), sum('native bf16' in str(x.message) for x in w))\n")
    env = clean_env(**({"ACCELERATE_C_CPU_BF16_MATMUL": setting} if setting else {}))
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.split() == (["True", "0"] if setting is None else ["False", "1"]), p.stdout + p.stderr[-2000:]
