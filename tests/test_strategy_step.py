# tests/test_strategy_step.py: the strategy owns the optimizer step (Strategy.step(optimizer, precision)) and each
# strategy's configuration is read in one place (StrategyConfig / DDPConfig.from_sources): a registered strategy's
# step is what optimizer.step() runs, the kernels-or-torch choice follows the config (results against a plain
# torch loop), the precision hooks, the kernels' partition protocol, config from a kwargs handler and from the
# environment, and the errors for bad values.
# Not for: the split step's numerics over shared memory (test_split_step.py) or fp16 end to end (test_precision.py).
import pytest
import torch

from accelerate_c import Accelerator, DistributedDataParallelKwargs, GradScalerKwargs
from accelerate_c.optim import fused_step
from accelerate_c.precision.policy import NO_SCALING, FP16Precision, Precision
from accelerate_c.state import AcceleratorState, GradientState
from accelerate_c.strategies import REGISTRY, register
from accelerate_c.ddp.config import StrategyConfig
from accelerate_c.ddp.config import DDPConfig
from accelerate_c.strategies.ddp_bucketed import BucketedDataParallel
from accelerate_c.strategies.single import SingleProcess
from accelerate_c.utils import patch_environment

CONFIG_VARS = ("ACCELERATE_C_FUSED_OPTIMIZER", "ACCELERATE_C_GRAD_SYNC", "ACCELERATE_C_COMM",
               "ACCELERATE_C_SHARDED_STEP")


@pytest.fixture(autouse=True)
def fresh_state(monkeypatch):
    for var in CONFIG_VARS:
        monkeypatch.delenv(var, raising=False)
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def _data(steps: int = 4):
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 6, generator=gen), torch.randn(8, 3, generator=gen)) for _ in range(steps)]


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def _reference(data):
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    for x, y in data:
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def _train(acc, data, **step_kw):
    model = _model()
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1))
    for x, y in data:
        acc.backward(((model(x) - y) ** 2).mean())
        opt.step(**step_kw)
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()], opt


@pytest.fixture
def recording_strategy():
    """A registered single-process strategy (wins by priority) that records its step calls."""
    calls = []

    class Recording(SingleProcess):
        priority = 1000
        skip = False

        def step(self, optimizer, precision, closure=None):
            calls.append((optimizer, precision, closure))
            if Recording.skip:
                return True  # a step this strategy decided to skip: nothing changes
            return super().step(optimizer, precision, closure)

    register("test_recording")(Recording)
    try:
        yield Recording, calls
    finally:
        REGISTRY.pop("test_recording", None)


def test_optimizer_step_is_the_strategy_step(recording_strategy):
    cls, calls = recording_strategy
    data = _data()
    acc = Accelerator(cpu=True)
    assert type(acc.strategy) is cls
    weights, opt = _train(acc, data)
    assert len(calls) == len(data)
    assert all(o is opt.optimizer and p is acc.precision and c is None for o, p, c in calls)
    for a, b in zip(weights, _reference(data)):  # the fused kernels: torch's AdamW to rounding
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_accumulating_steps_do_not_reach_the_strategy(recording_strategy):
    _, calls = recording_strategy
    acc = Accelerator(cpu=True, gradient_accumulation_steps=2)
    model = _model()
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    for x, y in _data(4):
        with acc.accumulate(model):
            acc.backward(((model(x) - y) ** 2).mean())
            opt.step()
            opt.zero_grad()
    assert len(calls) == 2  # one per synchronising iteration


def test_strategy_step_answer_is_step_was_skipped(recording_strategy):
    cls, _ = recording_strategy
    cls.skip = True
    acc = Accelerator(cpu=True)
    model = _model()
    before = [p.detach().clone() for p in model.parameters()]
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    acc.backward(model(torch.randn(2, 6)).sum())
    opt.step()
    assert opt.step_was_skipped and acc.optimizer_step_was_skipped
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def _count(monkeypatch, acc):
    seen = {"kernel": 0, "torch": 0}
    kernel_step, torch_step = acc.strategy.kernel_step, acc.precision.torch_step

    def counted_kernel(*a, **k):
        seen["kernel"] += 1
        return kernel_step(*a, **k)

    def counted_torch(*a, **k):
        seen["torch"] += 1
        return torch_step(*a, **k)

    monkeypatch.setattr(acc.strategy, "kernel_step", counted_kernel)
    monkeypatch.setattr(acc.precision, "torch_step", counted_torch)
    return seen


def test_fused_by_default_torch_when_turned_off(monkeypatch):
    data = _data()
    ref = _reference(data)
    acc = Accelerator(cpu=True)
    assert acc.strategy.config.fused_optimizer is True
    seen = _count(monkeypatch, acc)
    fused, _ = _train(acc, data)
    assert seen == {"kernel": len(data), "torch": 0}
    for a, b in zip(fused, ref):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    with patch_environment(ACCELERATE_C_FUSED_OPTIMIZER="0"):
        acc = Accelerator(cpu=True)
    assert acc.strategy.config.fused_optimizer is False
    seen = _count(monkeypatch, acc)
    plain, _ = _train(acc, data)
    assert seen == {"kernel": 0, "torch": len(data)}
    assert all(torch.equal(a, b) for a, b in zip(plain, ref))  # torch's own step: bit for bit


def test_closure_takes_the_torch_step(monkeypatch):
    data = _data()
    acc = Accelerator(cpu=True)
    seen = _count(monkeypatch, acc)
    evaluated = []
    weights, _ = _train(acc, data, closure=lambda: evaluated.append(1))
    assert seen == {"kernel": 0, "torch": len(data)} and len(evaluated) == len(data)
    assert all(torch.equal(a, b) for a, b in zip(weights, _reference(data)))


def test_precision_hooks():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(4))], lr=0.1)
    assert Precision(torch.device("cpu"), {}).kernel_scale(opt) is NO_SCALING
    fp16 = FP16Precision(torch.device("cpu"), {"GradScalerKwargs": GradScalerKwargs(init_scale=256.0)})
    fp16.scale_loss(torch.tensor(1.0))  # the scale exists from the first scaled loss on (GradScaler's rule)
    scale = fp16.kernel_scale(opt)
    assert scale.grad_scale == 1.0 / 256.0 and scale.check_nonfinite and not scale.skip
    opt.param_groups[0]["params"][0].grad = torch.tensor([1.0, float("inf"), 0.0, 0.0])
    fp16.unscale_(opt)  # unscaled already (clipping) and non-finite: the kernels must skip outright
    assert fp16.kernel_scale(opt).skip
    assert fp16.after_kernel_step(opt, skipped=True) is True and fp16.scaler.get_scale() == 128.0
    off = FP16Precision(torch.device("cpu"), {}, fused_kernels=False)
    assert off.kernel_scale(opt) is None  # GradScaler's own path
    disabled = FP16Precision(torch.device("cpu"), {"GradScalerKwargs": GradScalerKwargs(enabled=False)})
    assert disabled.kernel_scale(opt) is None


class _SecondHalf:
    """A partition that steps the second half of every tensor and mirrors the new values into `mirror`."""

    def __init__(self):
        self.calls, self.mirrors = [], {}

    def begin(self):
        self.calls.append("begin")

    def slice_lists(self, opt, params, grads, state_lists, lps):
        self.calls.append("slice")
        cut, mirrors, offsets = [], [None] * len(params), [0] * len(params)
        for i, p in enumerate(params):
            a, b = p.numel() // 2, p.numel()
            params[i], grads[i] = p.detach().view(-1)[a:b], grads[i].view(-1)[a:b]
            for lst in state_lists.values():
                if lst is not None and lst[i] is not None:
                    lst[i] = lst[i].view(-1)[a:b]
            mirrors[i] = self.mirrors.setdefault(id(p), torch.zeros(b - a))
            offsets[i] = a
            cut.append((p, a, b))
        return cut, mirrors, offsets

    def end(self, cut):
        self.calls.append(("end", len(cut)))


@pytest.mark.parametrize("name", ["AdamW", "SGD"])
def test_kernels_partition_protocol(name):
    torch.manual_seed(3)
    pa = [torch.nn.Parameter(torch.randn(10, 7)), torch.nn.Parameter(torch.randn(33))]
    pb = [torch.nn.Parameter(p.detach().clone()) for p in pa]
    kw = {"momentum": 0.9} if name == "SGD" else {}
    oa, ob = getattr(torch.optim, name)(pa, lr=0.1, **kw), getattr(torch.optim, name)(pb, lr=0.1, **kw)
    before = [p.detach().clone() for p in pa]
    for p, q in zip(pa, pb):
        p.grad = torch.randn_like(p)
        q.grad = p.grad.clone()
    part = _SecondHalf()
    assert fused_step(oa, partition=part) is True
    assert fused_step(ob) is True  # the whole step, the reference
    assert part.calls[0] == "begin" and part.calls[-1] == ("end", 2)
    for p, q, old in zip(pa, pb, before):
        a = p.numel() // 2
        assert torch.equal(p.detach().view(-1)[:a], old.view(-1)[:a])  # not ours: untouched
        assert torch.equal(p.detach().view(-1)[a:], q.detach().view(-1)[a:])
        assert torch.equal(part.mirrors[id(p)], q.detach().view(-1)[a:])


def test_ddp_config_defaults():
    cfg = DDPConfig.from_sources({}, env={})
    assert cfg == DDPConfig(fused_optimizer=True, grad_sync="bucketed", transport="auto", sharded_step=True,
                            bucket_cap_mb=25.0, broadcast_buffers=True, compress_dtype=None)


def test_ddp_config_from_kwargs_handler():
    kw = DistributedDataParallelKwargs(bucket_cap_mb=7, broadcast_buffers=False, comm_hook="bf16")
    cfg = DDPConfig.from_sources({"DistributedDataParallelKwargs": kw}, env={})
    assert (cfg.bucket_cap_mb, cfg.broadcast_buffers, cfg.compress_dtype) == (7.0, False, torch.bfloat16)
    with pytest.raises(ValueError, match="comm_hook='bogus'"):
        DDPConfig.from_sources({"DistributedDataParallelKwargs": DistributedDataParallelKwargs(comm_hook="bogus")},
                               env={})


def test_ddp_config_from_env():
    env = {"ACCELERATE_C_GRAD_SYNC": "reference", "ACCELERATE_C_COMM": "Torch", "ACCELERATE_C_SHARDED_STEP": "0",
           "ACCELERATE_C_FUSED_OPTIMIZER": "false"}
    cfg = DDPConfig.from_sources({}, env=env)
    assert (cfg.grad_sync, cfg.transport, cfg.sharded_step, cfg.fused_optimizer) == ("reference", "torch", False, False)
    with patch_environment(ACCELERATE_C_FUSED_OPTIMIZER="0"):  # os.environ when no mapping is given
        assert StrategyConfig.from_sources().fused_optimizer is False


@pytest.mark.parametrize("var,value", [("ACCELERATE_C_GRAD_SYNC", "fast"), ("ACCELERATE_C_COMM", "mpi"),
                                       ("ACCELERATE_C_SHARDED_STEP", "maybe"),
                                       ("ACCELERATE_C_FUSED_OPTIMIZER", "2")])
def test_bad_env_value_names_variable_and_value(var, value):
    with pytest.raises(ValueError, match=f"{var}='{value}'"):
        DDPConfig.from_sources({}, env={var: value})


def test_bad_env_value_fails_at_accelerator_and_selection():
    with patch_environment(ACCELERATE_C_FUSED_OPTIMIZER="yes please"):
        with pytest.raises(ValueError, match="ACCELERATE_C_FUSED_OPTIMIZER='yes please'"):
            Accelerator(cpu=True)

    class TwoProcesses:
        num_processes = 2

        class parallel_layout:  # noqa: N801 (two data-parallel ranks: what the strategies select on)
            dp_size = 2

    with patch_environment(ACCELERATE_C_GRAD_SYNC="fast"):
        with pytest.raises(ValueError, match="ACCELERATE_C_GRAD_SYNC='fast'.*bucketed, reference"):
            BucketedDataParallel.applies(TwoProcesses(), {})
    with patch_environment(ACCELERATE_C_GRAD_SYNC="reference"):
        assert not BucketedDataParallel.applies(TwoProcesses(), {})


def test_fp16_precision_follows_the_config():
    with patch_environment(ACCELERATE_C_FUSED_OPTIMIZER="0"):
        acc = Accelerator(cpu=True, mixed_precision="fp16")
    assert acc.strategy.config.fused_optimizer is False and acc.precision.use_fused is False
