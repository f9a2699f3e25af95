# tests/scripts/cpu_bf16_ops.py: each op of accelerate_c/precision/cpu_bf16.py's KERNELS under CPU autocast, first on
# torch's own kernels, then (same process, same inputs) after cpu_bf16.install(): outputs and input gradients for
# bf16 (ours against torch's and against the float64 result of the bf16-rounded inputs) and fp16 (torch's autocast
# rule, so the same bits). Writes a JSON report to argv[1]. Run by tests/test_cpu_bf16.py.
import json
import sys

import torch

from accelerate_c.precision import cpu_bf16

g = torch.Generator().manual_seed(0)


def t(*shape):
    return torch.randn(*shape, generator=g)


F = torch.nn.functional
BOOL_MASK = torch.rand(20, 20, generator=g) > 0.3
BOOL_MASK[:, 0] = True  # every query sees a key
CASES = {
    "linear": (F.linear, lambda: (t(6, 40), t(24, 40), t(24))),
    "linear_nobias": (F.linear, lambda: (t(2, 3, 40), t(24, 40))),
    "mm": (torch.mm, lambda: (t(6, 40), t(40, 24))),
    "addmm": (lambda b, x, w: torch.addmm(b, x, w, beta=0.5, alpha=2.0), lambda: (t(24), t(6, 40), t(40, 24))),
    "bmm": (torch.bmm, lambda: (t(3, 6, 40), t(3, 40, 24))),
    "baddbmm": (torch.baddbmm, lambda: (t(3, 6, 24), t(3, 6, 40), t(3, 40, 24))),
    "addbmm": (torch.addbmm, lambda: (t(6, 24), t(3, 6, 40), t(3, 40, 24))),
    "matmul_1d2d": (torch.matmul, lambda: (t(40), t(40, 24))),
    "matmul_3d2d": (torch.matmul, lambda: (t(2, 6, 40), t(40, 24))),
    "conv1d": (lambda x, w, b: F.conv1d(x, w, b, padding=1), lambda: (t(2, 4, 20), t(6, 4, 3), t(6))),
    "conv1d_same": (lambda x, w: F.conv1d(x, w, padding="same"), lambda: (t(2, 4, 20), t(6, 4, 3))),
    "conv2d": (lambda x, w, b: F.conv2d(x, w, b, stride=2), lambda: (t(2, 3, 9, 9), t(5, 3, 3, 3), t(5))),
    "conv2d_same": (lambda x, w: F.conv2d(x, w, padding="same"), lambda: (t(2, 3, 8, 8), t(5, 3, 3, 3))),
    "conv3d": (F.conv3d, lambda: (t(1, 2, 5, 5, 5), t(3, 2, 2, 2, 2))),
    "conv_transpose1d": (F.conv_transpose1d, lambda: (t(2, 4, 10), t(4, 3, 3))),
    "conv_transpose2d": (lambda x, w, b: F.conv_transpose2d(x, w, b, stride=2), lambda: (t(1, 4, 5, 5), t(4, 2, 3, 3),
                                                                                          t(2))),
    "conv_transpose3d": (F.conv_transpose3d, lambda: (t(1, 2, 3, 3, 3), t(2, 2, 2, 2, 2))),
    # attention: causal, an additive float mask (autocast rounds it too), a boolean mask, grouped KV heads
    "sdpa_causal": (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                    lambda: (t(2, 3, 24, 16), t(2, 3, 24, 16), t(2, 3, 24, 16))),
    "sdpa_float_mask": (lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m, scale=0.3),
                        lambda: (t(2, 3, 20, 8), t(2, 3, 28, 8), t(2, 3, 28, 8), t(20, 28))),
    "sdpa_bool_mask": (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=BOOL_MASK),
                       lambda: (t(1, 2, 20, 8), t(1, 2, 20, 8), t(1, 2, 20, 8))),
    "sdpa_gqa": (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
                 lambda: (t(2, 4, 16, 8), t(2, 2, 16, 8), t(2, 2, 16, 8))),
}


def run(fn, inputs, dtype):
    xs = [x.clone().requires_grad_(True) for x in inputs]
    with torch.autocast("cpu", dtype=dtype):
        y = fn(*xs)
    y.float().square().sum().backward()
    return y.detach(), [x.grad for x in xs]


def exact(fn, inputs):
    """float64 on the bf16-rounded inputs, then rounded to bf16 once"""
    with torch.autocast("cpu", enabled=False):
        return fn(*[x.to(torch.bfloat16).double() for x in inputs]).to(torch.bfloat16)


def ulps(a, b):
    """|a - b| in units of bf16's spacing at |b| (2^-7 relative; 1 where b is 0)"""
    a, b = a.double(), b.double()
    return ((a - b).abs() / (b.abs() * 2.0 ** -7).clamp_min(2.0 ** -126)).max().item()


inputs = {k: make() for k, (_, make) in CASES.items()}
torch_runs = {k: {dt: run(fn, inputs[k], dt) for dt in (torch.bfloat16, torch.float16)} for k, (fn, _) in CASES.items()}
installed = cpu_bf16.install()
report = {"installed": installed, "ops": {}}
for k, (fn, _) in CASES.items():
    (ty, tg), (ty16, tg16) = torch_runs[k][torch.bfloat16], torch_runs[k][torch.float16]
    (oy, og), (oy16, og16) = run(fn, inputs[k], torch.bfloat16), run(fn, inputs[k], torch.float16)
    report["ops"][k] = {
        "dtype": [str(ty.dtype), str(oy.dtype)], "shape": [list(ty.shape), list(oy.shape)],
        "differ_frac": (ty.float() != oy.float()).float().mean().item(),
        "ulps_vs_torch": ulps(oy, ty), "ulps_vs_exact": ulps(oy, exact(fn, inputs[k])),
        "torch_ulps_vs_exact": ulps(ty, exact(fn, inputs[k])),
        "grad_dtypes": [[str(a.dtype) for a in tg], [str(a.dtype) for a in og]],
        "grad_rel": max(((a - b).norm() / b.norm().clamp_min(1e-30)).item() for a, b in zip(og, tg)),
        "fp16_same": torch.equal(ty16, oy16) and ty16.dtype == oy16.dtype
        and all(torch.equal(a, b) for a, b in zip(tg16, og16)),
    }
with open(sys.argv[1], "w") as f:
    json.dump(report, f)
