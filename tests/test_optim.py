# test_optim.py: accelerate_c.optim (fused C Adam/AdamW/SGD) against torch.optim (foreach=False): numerics,
# SIMD-path and thread-count bit identity, state_dict exchange both ways, fused_step on torch optimizers,
# gradient scaling, skip-on-non-finite and the fused bf16/fp16 param copy.
# Not for: timing (benchmarks/optimizer.py).
import contextlib
import copy

import pytest
import torch
from simd_levels import LEVELS, simd

import accelerate_c._C as C
from accelerate_c import optim as aopt

SHAPES = [(1,), (17,), (5, 3), (33, 7), (1031,), (64, 65)]


@contextlib.contextmanager
def threads(n):
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def make_params(seed=0, shapes=SHAPES):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes]


def grads_for(params, steps, seed=1, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(p.shape, generator=g) * scale for p in params] for _ in range(steps)]


def close(a, b, rel=1e-6):
    """max |a-b| within rel * max|b| (+ a tiny absolute floor): state-level relative agreement."""
    a, b = a.detach().double(), b.detach().double()
    bound = rel * max(b.abs().max().item(), 1e-30) + 1e-12
    return (a - b).abs().max().item() <= bound


def run(opt, params, grads, sched=None):
    for gs in grads:
        for p, g in zip(params, gs):
            p.grad = g.clone()
        opt.step()
        if sched is not None:
            sched.step()


def groups_of(params, kind):
    if kind == "sgd":
        return [{"params": params[:2]}, {"params": params[2:4], "momentum": 0.9, "dampening": 0.1, "weight_decay": 0.01},
                {"params": params[4:], "momentum": 0.8, "nesterov": True, "lr": torch.tensor(0.05)}]
    return [{"params": params[:2]}, {"params": params[2:4], "lr": 3e-3, "betas": (0.8, 0.99), "weight_decay": 0.1},
            {"params": params[4:], "lr": torch.tensor(2e-3), "eps": 1e-6, "betas": (0.3, 0.9)}]


def assert_state_close(ours, ref, pa, pb, rel=1e-6):
    for a, b in zip(pa, pb):
        assert close(a, b, rel), (a.shape, (a - b).abs().max())
        sa, sb = ours.state[a], ref.state[b]
        assert sorted(sa) == sorted(sb)
        for k in sa:
            if k == "step":
                assert sa[k].dtype == sb[k].dtype and sa[k].shape == () and sa[k].item() == sb[k].item()
            else:
                assert close(sa[k], sb[k], rel), (k, a.shape)


@pytest.mark.parametrize("name", ["AdamW", "Adam"])
@pytest.mark.parametrize("amsgrad,maximize", [(False, False), (True, False), (False, True), (True, True)])
def test_adam_matches_torch(name, amsgrad, maximize):
    pa, pb = make_params(), make_params()
    grads = grads_for(pa, 12)
    kw = dict(lr=1e-2, weight_decay=0.05, amsgrad=amsgrad, maximize=maximize)
    ours = getattr(aopt, name)(groups_of(pa, "adam"), **kw)
    ref = getattr(torch.optim, name)(groups_of(pb, "adam"), foreach=False, **kw)
    sa = torch.optim.lr_scheduler.StepLR(ours, step_size=3, gamma=0.5)
    sb = torch.optim.lr_scheduler.StepLR(ref, step_size=3, gamma=0.5)
    run(ours, pa, grads, sa)
    run(ref, pb, grads, sb)
    assert isinstance(ours.param_groups[2]["lr"], torch.Tensor)
    assert_state_close(ours, ref, pa, pb)


def test_adamw_late_steps_match_torch():
    """From step 16,628 (beta2 0.999) sqrt(bc2) rounds to 1.0f and the kernels' common-call loop leaves out the
    division by it (csrc/optim/adam_update.h): still torch's update, across the step where it starts."""
    pa, pb = make_params(), make_params()
    grads = grads_for(pa, 4)
    ours, ref = aopt.AdamW(pa, lr=1e-2, weight_decay=0.05), torch.optim.AdamW(pb, lr=1e-2, weight_decay=0.05,
                                                                               foreach=False)
    run(ours, pa, grads[:1])
    run(ref, pb, grads[:1])
    for o in (ours, ref):
        for st in o.state.values():
            st["step"].fill_(16626.0)
    run(ours, pa, grads[1:])
    run(ref, pb, grads[1:])
    assert_state_close(ours, ref, pa, pb)
    assert all(st["step"].item() == 16629.0 for st in ours.state.values())


@pytest.mark.parametrize("maximize", [False, True])
def test_sgd_matches_torch(maximize):
    pa, pb = make_params(), make_params()
    grads = grads_for(pa, 11)
    ours = aopt.SGD(groups_of(pa, "sgd"), lr=0.1, maximize=maximize)
    ref = torch.optim.SGD(groups_of(pb, "sgd"), lr=0.1, maximize=maximize, foreach=False)
    sa = torch.optim.lr_scheduler.ExponentialLR(ours, gamma=0.9)
    sb = torch.optim.lr_scheduler.ExponentialLR(ref, gamma=0.9)
    run(ours, pa, grads, sa)
    run(ref, pb, grads, sb)
    assert_state_close(ours, ref, pa, pb)
    assert "momentum_buffer" not in ours.state[pa[0]] and "momentum_buffer" not in ref.state[pb[0]]


def _flat_sequence(level, nthreads, n=100_003):
    """A mixed workload through the flat entry points: bf16/fp16/fp32 grads, amsgrad, maximize, grad scale,
    bf16/fp16 copies, SGD with nesterov. Returns every output tensor."""
    g = torch.Generator().manual_seed(7)
    p1, p2, p3 = (torch.randn(n, generator=g) for _ in range(3))
    m1, v1, x1 = torch.zeros(n), torch.zeros(n), torch.zeros(n)
    m2, v2 = torch.zeros(n), torch.zeros(n)
    buf = torch.empty(n)
    lp1, lp2, lp3 = torch.empty(n, dtype=torch.bfloat16), torch.empty(n, dtype=torch.float16), torch.empty(n, dtype=torch.bfloat16)
    with simd(level), threads(nthreads):
        for step in range(1, 6):
            gr = torch.randn(n, generator=g)
            aopt.adamw_flat_(p1, gr.to(torch.bfloat16), m1, v1, step, 1e-2, weight_decay=0.1, amsgrad=True,
                             max_exp_avg_sq=x1, maximize=True, grad_scale=0.5, low_precision_out=lp1)
            aopt.adam_flat_(p2, gr.to(torch.float16), m2, v2, step, 1e-2, (0.2, 0.99), weight_decay=0.1,
                            low_precision_out=lp2)
            aopt.sgd_flat_(p3, gr, buf, 0.05, momentum=0.9, weight_decay=0.01, nesterov=True, first_step=step == 1,
                           grad_scale=0.25, low_precision_out=lp3)
    return [p1, m1, v1, x1, p2, m2, v2, p3, buf, lp1, lp2, lp3]


def test_simd_paths_bit_identical():
    outs = {lv: _flat_sequence(lv, 1) for lv in LEVELS}
    base = outs["scalar"]
    for lv in LEVELS[1:]:
        for a, b in zip(outs[lv], base):
            assert torch.equal(a.view(torch.int16) if a.element_size() == 2 else a.view(torch.int32),
                               b.view(torch.int16) if b.element_size() == 2 else b.view(torch.int32)), lv


def test_threads_bit_identical():
    lv = LEVELS[-1]
    for a, b in zip(_flat_sequence(lv, 1), _flat_sequence(lv, 2)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name", ["AdamW", "SGD"])
def test_state_dict_round_trip(name):
    kind = "sgd" if name == "SGD" else "adam"
    grads = grads_for(make_params(), 8)
    for first, second in ((getattr(aopt, name), getattr(torch.optim, name)),
                          (getattr(torch.optim, name), getattr(aopt, name))):
        pa, pb = make_params(), make_params()
        kw = {"foreach": False} if first.__module__.startswith("torch") else {}
        o1 = first(groups_of(pa, kind), lr=1e-2, **kw)
        run(o1, pa, grads[:4])
        sd = copy.deepcopy(o1.state_dict())
        with torch.no_grad():
            for a, b in zip(pa, pb):
                b.copy_(a)
        o2 = second(groups_of(pb, kind), lr=1e-2)
        o2.load_state_dict(sd)
        run(o1, pa, grads[4:])
        run(o2, pb, grads[4:])
        assert_state_close(o2, o1, pb, pa)
        if kind == "adam":
            assert o2.state[pb[0]]["step"].item() == 8.0 and o2.state[pb[0]]["step"].dtype == torch.float32


@pytest.mark.parametrize("name", ["AdamW", "Adam", "SGD"])
def test_fused_step_on_torch_optimizer(name):
    kind = "sgd" if name == "SGD" else "adam"
    pa, pb = make_params(), make_params()
    grads = grads_for(pa, 10)
    oa = getattr(torch.optim, name)(groups_of(pa, kind), lr=1e-2, weight_decay=0.01)
    ob = getattr(torch.optim, name)(groups_of(pb, kind), lr=1e-2, weight_decay=0.01, foreach=False)
    sa = torch.optim.lr_scheduler.StepLR(oa, step_size=2, gamma=0.7)
    for gs in grads:
        for p, g in zip(pa, gs):
            p.grad = g.clone()
        assert aopt.fused_step(oa) is True
        sa.step()
    sb = torch.optim.lr_scheduler.StepLR(ob, step_size=2, gamma=0.7)
    run(ob, pb, grads, sb)
    assert_state_close(oa, ob, pa, pb)
    # the torch object still works on its own afterwards
    oa.step()
    assert type(oa.state_dict()["state"][0]) is dict


def test_fused_step_unsupported_returns_false():
    class MyAdam(torch.optim.Adam):
        pass

    p = torch.nn.Parameter(torch.randn(4))
    p.grad = torch.randn(4)
    assert aopt.fused_step(MyAdam([p])) is False
    q = torch.nn.Parameter(torch.randn(4, dtype=torch.float64))
    q.grad = torch.randn(4, dtype=torch.float64)
    o = torch.optim.AdamW([{"params": [p]}, {"params": [q]}])
    before = p.detach().clone()
    assert aopt.fused_step(o) is False
    assert torch.equal(p, before) and len(o.state) == 0
    o = torch.optim.Adam([p], differentiable=True)
    assert aopt.fused_step(o) is False


def test_fallback_group_in_our_optimizer():
    pa = [torch.nn.Parameter(torch.randn(9)), torch.nn.Parameter(torch.randn(5, dtype=torch.float64))]
    pb = [torch.nn.Parameter(t.detach().clone()) for t in pa]
    grads = [[torch.randn_like(p) for p in pa] for _ in range(5)]
    oa = aopt.AdamW([{"params": [pa[0]]}, {"params": [pa[1]]}], lr=1e-2)
    ob = torch.optim.AdamW([{"params": [pb[0]]}, {"params": [pb[1]]}], lr=1e-2, foreach=False)
    run(oa, pa, grads)
    run(ob, pb, grads)
    assert close(pa[0], pb[0]) and torch.equal(pa[1], pb[1])


@pytest.mark.parametrize("name", ["AdamW", "SGD"])
def test_grad_scale_and_skip_nonfinite(name):
    kind = "sgd" if name == "SGD" else "adam"
    pa, pb = make_params(), make_params()
    grads = grads_for(pa, 6, scale=1024.0)
    oa = getattr(torch.optim, name)(groups_of(pa, kind), lr=1e-2, momentum=0.9) if kind == "sgd" else \
        torch.optim.AdamW(groups_of(pa, kind), lr=1e-2)
    ob = getattr(torch.optim, name)(groups_of(pb, kind), lr=1e-2, momentum=0.9, foreach=False) if kind == "sgd" \
        else torch.optim.AdamW(groups_of(pb, kind), lr=1e-2, foreach=False)
    for k, gs in enumerate(grads):
        for p, q, g in zip(pa, pb, gs):
            p.grad = g.clone()
            q.grad = g * (1.0 / 1024.0)
        assert aopt.fused_step(oa, grad_scale=1.0 / 1024.0, skip_if_nonfinite=True) is True
        ob.step()
        if k == 2:  # one bad gradient in the last tensor: nothing at all may change
            snap = copy.deepcopy((oa.state_dict(), [p.detach().clone() for p in pa]))
            pa[-1].grad[3, 4] = float("inf") if k % 2 == 0 else float("nan")
            assert aopt.fused_step(oa, grad_scale=1.0 / 1024.0, skip_if_nonfinite=True) is None
            sd, ps = oa.state_dict(), [p.detach() for p in pa]
            assert all(torch.equal(a, b) for a, b in zip(ps, snap[1]))
            for i, st in sd["state"].items():
                for key, val in st.items():
                    assert torch.equal(val, snap[0]["state"][i][key])
    assert_state_close(oa, ob, pa, pb)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_copy_equals_cast(dtype):
    # values across the whole float range (normals, subnormals, fp16 overflow, signed zeros, inf)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4099, generator=g) * torch.pow(2.0, torch.randint(-140, 127, (4099,), generator=g).float())
    x[:8] = torch.tensor([0.0, -0.0, 65504.0, 65519.0, 65520.0, -70000.0, 2.0 ** -25, 3 * 2.0 ** -26])
    x[8:10] = torch.tensor([float("inf"), -float("inf")])
    for lv in LEVELS:
        p = x.clone()
        out = torch.empty_like(x, dtype=dtype)
        with simd(lv):  # lr = 0 and zero gradients: the param stays bit-identical, the copy is a pure cast
            aopt.sgd_flat_(p, torch.zeros_like(x), None, 0.0, low_precision_out=out)
        assert torch.equal(p.view(torch.int32), x.view(torch.int32))
        assert torch.equal(out.view(torch.int16), x.to(dtype).view(torch.int16)), lv
    # a copy big enough (>= 2M elements) for the non-temporal store path, with a bf16/fp16 gradient
    n = (1 << 21) + 37
    p0 = torch.randn(n, generator=g)
    gr = torch.randn(n, generator=g).to(dtype)
    for lv in LEVELS:
        p, m, v = p0.clone(), torch.zeros(n), torch.zeros(n)
        out = torch.empty(n, dtype=dtype)
        with simd(lv):
            aopt.adamw_flat_(p, gr, m, v, 1, 1e-2, low_precision_out=out)
        ref_p, ref_m, ref_v = p0.clone(), torch.zeros(n), torch.zeros(n)
        aopt.adamw_flat_(ref_p, gr.float(), ref_m, ref_v, 1, 1e-2)  # the upcast in the pass is exact
        assert torch.equal(p, ref_p) and torch.equal(m, ref_m) and torch.equal(v, ref_v)
        assert torch.equal(out.view(torch.int16), p.to(dtype).view(torch.int16)), lv
    # through fused_step on a real optimizer, the copy equals master.to(dtype)
    ps = make_params()
    opt = torch.optim.AdamW(ps, lr=1e-2)
    copies = {p: torch.empty_like(p, dtype=dtype) for p in ps}
    for gs in grads_for(ps, 3):
        for p, gr in zip(ps, gs):
            p.grad = gr
        assert aopt.fused_step(opt, low_precision_copies=copies) is True
        for p in ps:
            assert torch.equal(copies[p], p.detach().to(dtype))


def test_nan_copy_and_nonfinite_check():
    x = torch.tensor([float("nan"), 1.0, -float("nan")] * 7)
    out = torch.empty(21, dtype=torch.bfloat16)
    aopt.sgd_flat_(x.clone(), torch.zeros(21), None, 0.0, low_precision_out=out)
    assert torch.isnan(out[0::3].float()).all() and torch.isnan(out[2::3].float()).all()
    p, g = torch.randn(50), torch.randn(50)
    g[7] = float("nan")
    before = p.clone()
    assert aopt.adamw_flat_(p, g, torch.zeros(50), torch.zeros(50), 1, 0.1, skip_if_nonfinite=True) is False
    assert torch.equal(p, before)
    for lv in LEVELS:
        with simd(lv):
            for dt in (torch.float32, torch.bfloat16, torch.float16):
                g = torch.ones(1000, dtype=dt)
                assert aopt.grads_nonfinite([g, g]) is False
                g[999] = float("inf")
                assert aopt.grads_nonfinite([torch.ones(3), g]) is True
                g[999] = 1.0
                assert aopt.grads_nonfinite([g], grad_scale=float("inf")) is True


@pytest.mark.parametrize("level", LEVELS)
def test_mirror_output_equals_updated_param(level):
    """adam_step/sgd_step `mirrors`: each given fp32 tensor receives the updated param in the same pass
    (the split DDP step writes a peer's replica this way); None entries are skipped; the update itself is
    unchanged."""
    g = torch.Generator().manual_seed(3)
    ps = [torch.randn(n, generator=g) for n in (1, 17, 1031, 4099)]
    gs = [torch.randn(p.shape, generator=g) for p in ps]
    with simd(level):
        ref = [p.clone() for p in ps]
        ms, vs = [torch.zeros_like(p) for p in ps], [torch.zeros_like(p) for p in ps]
        C.adam_step(ref, gs, ms, vs, None, 1.0, None, 1e-2, 0.9, 0.999, 1e-8, 0.1, True, False, False, 1.0, 2, False)
        got = [p.clone() for p in ps]
        ms, vs = [torch.zeros_like(p) for p in ps], [torch.zeros_like(p) for p in ps]
        mir = [torch.full_like(p, 7.0) for p in ps]
        C.adam_step(got, gs, ms, vs, None, 1.0, None, 1e-2, 0.9, 0.999, 1e-8, 0.1, True, False, False, 1.0, 2, False,
                    [mir[0], None, mir[2], mir[3]])
        for i, (r, a, m) in enumerate(zip(ref, got, mir)):
            assert torch.equal(r, a)
            assert torch.equal(m, a) if i != 1 else bool((m == 7.0).all())
        sref = [p.clone() for p in ps]
        C.sgd_step(sref, gs, [torch.empty_like(p) for p in ps], [True] * 4, None, 0.1, 0.9, 0.0, 1e-3, True, False,
                   1.0, 1)
        sgot, smir = [p.clone() for p in ps], [torch.zeros_like(p) for p in ps]
        C.sgd_step(sgot, gs, [torch.empty_like(p) for p in ps], [True] * 4, None, 0.1, 0.9, 0.0, 1e-3, True, False,
                   1.0, 1, smir)
        for r, a, m in zip(sref, sgot, smir):
            assert torch.equal(r, a) and torch.equal(m, a)
    with pytest.raises(ValueError, match=r"mirrors\[0\] has 3 elements"):
        C.sgd_step(sgot, gs, None, None, None, 0.1, 0.0, 0.0, 0.0, False, False, 1.0, 1, [torch.zeros(3)] * 4)
