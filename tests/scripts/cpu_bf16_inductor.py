# tests/scripts/cpu_bf16_inductor.py: accelerate_c/precision/cpu_bf16.py's kernels in graphs inductor compiles. A
# small model of replaced ops only (linear, attention, linear: ops between them would be inductor's own bf16
# arithmetic, which skips roundings eager makes, with torch's kernels as with ours) under bf16 autocast, eager and
# through torch.compile(backend="inductor"): autocast inside the compiled function (as a prepared model's forward has
# it), forward and backward. Writes whether outputs and gradients equal eager's bit for bit and the fraction of
# outputs that differ to argv[1] (JSON). Run by tests/test_cpu_bf16.py.
import json
import sys

import torch

from accelerate_c.precision import cpu_bf16

cpu_bf16.install()
F = torch.nn.functional


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.out = torch.nn.Linear(32, 192), torch.nn.Linear(64, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(2, 24, 3, 4, 16).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(2, 24, 64)
        return self.out(a)


torch.manual_seed(0)
net = Net()
x = torch.randn(2, 24, 32)


def forward(x: torch.Tensor) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return net(x)


def train_case(fn):
    net.zero_grad()
    y = fn(x)
    y.float().square().sum().backward()
    return y.detach(), [p.grad.clone() for p in net.parameters()]


report = {}
(ye, ge), (yc, gc) = train_case(forward), train_case(torch.compile(forward, backend="inductor"))
report["inside_train"] = {"dtype": str(yc.dtype), "out_equal": torch.equal(ye, yc),
                          "differ": (ye != yc).float().mean().item(),
                          "grads_equal": all(torch.equal(a, b) for a, b in zip(ge, gc))}
with open(sys.argv[1], "w") as f:
    json.dump(report, f)
