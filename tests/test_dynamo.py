# tests/test_dynamo.py: torch.compile through the Accelerator: TorchDynamoPlugin's fields from arguments and from
# HF's ACCELERATE_DYNAMO_* variables (against HF's own plugin), the torch.compile call prepare() makes (against
# HF's prepare on the same plugin), training a compiled model (backends eager / aot_eager, and inductor once: its C++
# build takes ~20 s) against the uncompiled loop, and regional compilation (against HF's compile_regions).
# Not for: torch.compile itself.
import importlib

import pytest
import torch
from conftest import reset_state

_ENV = ("ACCELERATE_DYNAMO_BACKEND", "ACCELERATE_DYNAMO_MODE", "ACCELERATE_DYNAMO_USE_FULLGRAPH",
        "ACCELERATE_DYNAMO_USE_DYNAMIC", "ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION")


@pytest.fixture(autouse=True)
def clean(monkeypatch, clean_state):
    for k in _ENV:
        monkeypatch.delenv(k, raising=False)


def _plugin(mod_name: str, **kw):
    return importlib.import_module(f"{mod_name}.utils").TorchDynamoPlugin(**kw)


def _describe(p) -> tuple:
    return (p.backend.value, p.mode, p.fullgraph, p.dynamic, p.use_regional_compilation, p.to_dict(), p.to_kwargs())


@pytest.mark.parametrize("env,kw", [
    ({}, {}),
    ({"ACCELERATE_DYNAMO_BACKEND": "aot_eager", "ACCELERATE_DYNAMO_MODE": "reduce-overhead",
      "ACCELERATE_DYNAMO_USE_FULLGRAPH": "true", "ACCELERATE_DYNAMO_USE_DYNAMIC": "false",
      "ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION": "1"}, {}),
    ({"ACCELERATE_DYNAMO_BACKEND": "INDUCTOR", "ACCELERATE_DYNAMO_USE_DYNAMIC": "yes"}, {"backend": "eager"}),
    ({}, {"backend": "EAGER", "mode": "max-autotune", "fullgraph": True, "dynamic": True, "options": {"a": 1}}),
])
def test_plugin_fields_match_hf(monkeypatch, env, kw):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert _describe(_plugin("accelerate_c", **kw)) == _describe(_plugin("accelerate", **kw))


def test_unknown_backend_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown dynamo backend 'nope'"):
        _plugin("accelerate_c", backend="nope")


def test_backend_and_plugin_are_exclusive_as_hf():
    errors = []
    for mod_name in ("accelerate_c", "accelerate"):
        mod = importlib.import_module(mod_name)
        with pytest.raises(ValueError) as e:
            mod.Accelerator(cpu=True, dynamo_backend="eager", dynamo_plugin=_plugin(mod_name))
        errors.append(str(e.value))
        reset_state(mod_name)
    assert errors[0] == errors[1]


def _compile_calls(mod_name: str, monkeypatch, **acc_kwargs) -> tuple:
    """What prepare() passes to torch.compile (recorded, not compiled), and the state's plugin."""
    calls = []
    mod = importlib.import_module(mod_name)
    with monkeypatch.context() as m:
        m.setattr(torch, "compile", lambda model, **kw: calls.append((type(model).__name__, kw)) or model)
        acc = mod.Accelerator(cpu=True, **acc_kwargs)
        acc.prepare(torch.nn.Linear(2, 2))
    backend = acc.state.dynamo_plugin.backend.value
    reset_state(mod_name)
    return calls, backend


@pytest.mark.parametrize("kind", ["backend", "plugin", "env", "none"])
def test_prepare_calls_torch_compile_like_hf(monkeypatch, kind):
    def run(mod_name):
        monkeypatch.delenv("ACCELERATE_DYNAMO_BACKEND", raising=False)
        if kind == "env":
            monkeypatch.setenv("ACCELERATE_DYNAMO_BACKEND", "aot_eager")
            monkeypatch.setenv("ACCELERATE_DYNAMO_USE_FULLGRAPH", "true")
        kwargs = {"backend": {"dynamo_backend": "eager"},
                  "plugin": {"dynamo_plugin": _plugin(mod_name, backend="eager", mode="max-autotune", dynamic=False,
                                                      options={"x": 1})},
                  "env": {}, "none": {}}[kind]
        return _compile_calls(mod_name, monkeypatch, **kwargs)

    ours, hf = run("accelerate_c"), run("accelerate")
    assert ours == hf
    assert (len(ours[0]) == 0) == (kind == "none")


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x)) + x


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(3, 6)
        self.blocks = torch.nn.ModuleList(Block() for _ in range(3))
        self.head = torch.nn.Linear(6, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _train(steps: int = 3, **acc_kwargs) -> tuple:
    import accelerate_c

    acc = accelerate_c.Accelerator(cpu=True, **acc_kwargs)
    torch.manual_seed(0)
    net = Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    model, opt = acc.prepare(net, opt)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        x, y = torch.randn(4, 3, generator=g), torch.randn(4, 1, generator=g)
        loss = torch.nn.functional.mse_loss(model(x), y)
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    unwrapped = acc.unwrap_model(model, keep_torch_compile=False)
    params = [p.detach().clone() for p in unwrapped.parameters()]
    reset_state("accelerate_c")
    return model, unwrapped is net, losses, params


@pytest.mark.parametrize("how", ["backend", "inductor", "env_regional"])
def test_compiled_training_matches_eager_loop(monkeypatch, tmp_path, run, how):
    from accelerate_c.utils.other import has_compiled_regions, is_compiled_module

    _, _, ref_losses, ref_params = _train()
    if how == "backend":
        model, same, losses, params = _train(dynamo_backend="eager")
        assert is_compiled_module(model)
        atol = 0.0
    elif how == "inductor":  # the default backend of `accelerate config` and of the Trainer's torch_compile=True
        # its C++ builds in the session's scratch folder (TORCHINDUCTOR_CACHE_DIR, set by conftest.py)
        run("dynamo_inductor.py", [str(tmp_path / "out.pt")], timeout=300)
        r = torch.load(tmp_path / "out.pt")
        assert r["compiled"]
        same, losses, params = r["same"], r["losses"], r["params"]
        atol = 1e-5  # generated C++ kernels: other summation orders and fused tanh
    else:
        monkeypatch.setenv("ACCELERATE_DYNAMO_BACKEND", "aot_eager")
        monkeypatch.setenv("ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION", "true")
        model, same, losses, params = _train()
        assert not is_compiled_module(model) and has_compiled_regions(model)
        assert all(is_compiled_module(b) for b in model.blocks) and is_compiled_module(model.head)
        atol = 1e-6  # aot_eager traces through AOTAutograd: same ops, possibly regrouped
    assert same, "unwrap_model(keep_torch_compile=False) returns the user's module"
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=0, atol=atol)
    for p, r in zip(params, ref_params):
        torch.testing.assert_close(p, r, rtol=0, atol=atol)


def test_regional_compilation_matches_hf_structure():
    from accelerate.utils import compile_regions as hf_compile_regions

    from accelerate_c.utils import compile_regions

    def layout(compiled):
        return [(name, type(m).__name__) for name, m in compiled.named_modules() if "_orig_mod" not in name]

    torch.manual_seed(0)
    net = Net()
    ours, hf = compile_regions(net, backend="eager"), hf_compile_regions(net, backend="eager")
    assert layout(ours) == layout(hf)
    assert ours.__dict__["_orig_mod"] is net and type(net.blocks[0]) is Block, "the original stays untouched"
    x = torch.randn(2, 3)
    torch.testing.assert_close(ours(x), net(x), rtol=0, atol=0)


def test_compiled_model_checkpoint_round_trip(tmp_path):
    import accelerate_c

    acc = accelerate_c.Accelerator(cpu=True, dynamo_backend="eager", project_dir=str(tmp_path))
    torch.manual_seed(0)
    net = Net()
    model = acc.prepare(net)
    inner = model._orig_mod
    saved = {k: v.clone() for k, v in net.state_dict().items()}
    acc.save_state(str(tmp_path / "ckpt"))
    with torch.no_grad():
        for p in net.parameters():
            p.add_(1.0)
    acc.load_state(str(tmp_path / "ckpt"))
    for k, v in net.state_dict().items():
        assert torch.equal(v, saved[k]), k
    assert model._orig_mod is inner, "load_state must not re-point the compiled wrapper"
    assert sorted(acc.get_state_dict(model)) == sorted(saved)
