# tests/test_views_unit.py: the parameter classes of sharding/views.py on one process, against plain torch: a
# PendingGrad is gathered only when an op needs its values (metadata, `is not None` and `p.grad = None` gather
# nothing), then behaves as the tensor it resolves to, torch's own clip_grad_norm_ writing into it; a stand-in
# answers shape / numel / dtype / requires_grad / hooks as the full parameter, is never larger than its storage,
# gathers once on its first op (reading, `.cpu()`, state_dict(), load_state_dict, deepcopy) and then is the
# gathered tensor. A fake engine stands for the sharded one (which tests/test_sharded_views.py runs for real).
# Not for: the engine's collectives.
import copy

import torch

from accelerate_c.sharding.views import PendingGrad, attach, raw_grad, set_standin, standin_data


class FakeEngine:
    """Holds full values and gradients by entry; counts the gathers user code triggered."""

    def __init__(self, params, values, grads):
        self.params, self.values, self.grads = params, values, grads
        self.param_gathers, self.grad_gathers, self.set_calls = 0, 0, []

    def visible_grad(self, i):
        def resolve():
            self.grad_gathers += 1
            return self.grads[i]
        return PendingGrad(self.grads[i].shape, self.grads[i].dtype, self.grads[i].device, resolve)

    def set_visible_grad(self, i, value):
        self.set_calls.append((i, value))

    def materialize_param(self, i):
        self.param_gathers += 1
        p = self.params[i]
        set_standin(p, False)
        p.data = self.values[i].clone()


def _model():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    values = [p.detach().clone() for p in m.parameters()]
    grads = [torch.randn_like(v) for v in values]
    eng = FakeEngine(list(m.parameters()), values, grads)
    for i, p in enumerate(m.parameters()):
        attach(p, eng, i)
        p.data = standin_data(tuple(p.shape), p.dtype, p.device)
        set_standin(p, True)
    return m, eng, values, grads


def _extent_ok(t):
    with torch._C.DisableTorchFunctionSubclass():
        need = t.storage_offset() + sum((n - 1) * s for n, s in zip(t.shape, t.stride())) + 1
        return need * t.element_size() <= t.untyped_storage().nbytes()


def test_standins_answer_metadata_and_gather_on_first_use():
    m, eng, values, _ = _model()
    w = m[0].weight
    assert isinstance(w, torch.nn.Parameter) and w.shape == (3, 4) and w.numel() == 12 and w.dtype == torch.float32
    assert w.requires_grad and w.is_leaf and w.dim() == 2 and len(w) == 3 and _extent_ok(w)
    h = w.register_hook(lambda g: g)
    h.remove()
    assert sum(p.numel() for p in m.parameters()) == 12 + 3 + 6 + 2
    assert eng.param_gathers == 0
    assert torch.equal(w.detach(), values[0]) and eng.param_gathers == 1
    assert float(w.detach().sum()) == float(values[0].sum()) and eng.param_gathers == 1  # (gathered once, then plain)
    sd = m.state_dict()
    assert all(torch.equal(sd[k], v) for k, v in zip(sd, values)) and eng.param_gathers == 4
    assert raw_grad(m[1].bias) is None


def test_standin_reads_cpu_numpy_deepcopy_and_load_state_dict():
    m, eng, values, _ = _model()
    assert (m[1].weight.data.numpy() == values[2].numpy()).all()
    c = copy.deepcopy(m[0])
    assert type(c.weight) is torch.nn.Parameter and torch.equal(c.weight, values[0])
    m.cpu()
    assert torch.equal(m[0].bias, values[1]) and eng.param_gathers == 4
    m2, eng2, values2, _ = _model()
    m2.load_state_dict({k: v * 2 for k, v in m.state_dict().items()})
    assert torch.equal(m2[0].weight.detach(), 2 * values[0]) and eng2.param_gathers == 4


def test_pending_grads_gather_only_for_values():
    m, eng, _, grads = _model()
    g = m[0].weight.grad
    assert isinstance(g, PendingGrad) and g is not None and g.shape == (3, 4) and g.dtype == torch.float32
    m.zero_grad()  # Module.zero_grad: `p.grad is not None`, then `p.grad = None`: no gather
    assert eng.grad_gathers == 0 and [i for i, v in eng.set_calls] == [0, 1, 2, 3]
    assert all(v is None for _, v in eng.set_calls)
    assert torch.allclose(m[0].weight.grad, grads[0]) and eng.grad_gathers == 1
    assert "tensor(" in repr(m[1].bias.grad)


def test_torch_clip_grad_norm_writes_into_the_gathered_gradients():
    m, eng, _, grads = _model()
    want = [g.clone() for g in grads]
    ref_params = [torch.nn.Parameter(torch.zeros_like(g)) for g in want]
    for p, g in zip(ref_params, want):
        p.grad = g
    ref = torch.nn.utils.clip_grad_norm_(ref_params, 0.1)
    got = torch.nn.utils.clip_grad_norm_(m.parameters(), 0.1)
    assert torch.allclose(got, ref)
    for g, p in zip(grads, ref_params):  # the engine's tensors (what it steps with) hold the clipped values
        assert torch.allclose(g, p.grad)
