# tests/test_accelerator.py: single-process behaviour of the Accelerator façade against HF Accelerate 1.15
# run side by side in the same process (state reset between the two): the accumulation/sync sequence,
# optimizer no-ops while accumulating, scheduler stepping, backward's division, argument validation and
# the C base type. Not for: multi-process parity (test_parity.py).
import importlib

import pytest
import torch
from conftest import reset_state


pytestmark = pytest.mark.usefixtures("clean_state")


def _run_loop(mod_name, grad_accum, n_samples, batch, sched_cls="step"):
    mod = importlib.import_module(mod_name)
    acc = mod.Accelerator(gradient_accumulation_steps=grad_accum, cpu=True)
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    ds = torch.utils.data.TensorDataset(torch.randn(n_samples, 3), torch.randn(n_samples, 2))
    dl = torch.utils.data.DataLoader(ds, batch_size=batch)
    model, opt, dl, sched = acc.prepare(model, opt, dl, sched)
    trace = []
    for x, y in dl:
        with acc.accumulate(model):
            loss = torch.nn.functional.mse_loss(model(x), y)
            acc.backward(loss)
            grad = model.weight.grad.clone()
            opt.step()
            sched.step()
            opt.zero_grad()
            trace.append((acc.sync_gradients, acc.step, acc.gradient_state.end_of_dataloader,
                          sched.get_last_lr()[0], grad, model.weight.detach().clone(), loss.item()))
    reset_state(mod_name)
    return trace


@pytest.mark.parametrize("grad_accum,n,batch", [(1, 10, 2), (2, 10, 2), (3, 10, 2), (4, 7, 1)])
def test_accumulation_matches_hf(grad_accum, n, batch):
    ours = _run_loop("accelerate_c", grad_accum, n, batch)
    hf = _run_loop("accelerate", grad_accum, n, batch)
    assert len(ours) == len(hf)
    for i, (a, b) in enumerate(zip(ours, hf)):
        assert a[:4] == b[:4], f"micro-step {i}: ours {a[:4]} vs HF {b[:4]}"
        torch.testing.assert_close(a[4], b[4], rtol=0, atol=1e-7)
        torch.testing.assert_close(a[5], b[5], rtol=0, atol=1e-7)
        assert abs(a[6] - b[6]) < 1e-6


def test_backward_divides_by_accumulation_steps_outside_accumulate():
    import accelerate_c
    acc = accelerate_c.Accelerator(gradient_accumulation_steps=4)
    w = torch.ones(3, requires_grad=True)
    acc.backward((w * 2).sum())
    assert torch.equal(w.grad, torch.full((3,), 0.5))


def test_optimizer_and_scheduler_are_noops_while_accumulating():
    import accelerate_c
    acc = accelerate_c.Accelerator(gradient_accumulation_steps=2)
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    model, opt = acc.prepare(model, opt)
    before = model.weight.detach().clone()
    with acc.accumulate(model):
        acc.backward(model(torch.ones(1, 2)).sum())
        assert not acc.sync_gradients
        opt.step()
        opt.zero_grad()
    assert torch.equal(model.weight, before) and model.weight.grad is not None
    with acc.accumulate(model):
        acc.backward(model(torch.ones(1, 2)).sum())
        assert acc.sync_gradients
        opt.step()
    assert not torch.equal(model.weight, before)


def test_kwargs_handler_validation():
    import accelerate_c
    from accelerate_c import DistributedDataParallelKwargs, GradientAccumulationPlugin
    with pytest.raises(ValueError, match="only pass one DistributedDataParallelKwargs"):
        accelerate_c.Accelerator(kwargs_handlers=[DistributedDataParallelKwargs(), DistributedDataParallelKwargs()])
    with pytest.raises(ValueError, match="gradient_accumulation_plugin"):
        accelerate_c.Accelerator(gradient_accumulation_steps=2,
                                 gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=2))
    with pytest.raises(ValueError, match="mixed_precision"):
        accelerate_c.Accelerator(mixed_precision="fp4")


def test_env_defaults(monkeypatch):
    import accelerate_c
    monkeypatch.setenv("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "3")
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    acc = accelerate_c.Accelerator()
    assert acc.gradient_accumulation_steps == 3 and acc.mixed_precision == "bf16"


def test_prepare_returns_same_order_and_types():
    import accelerate_c
    from accelerate_c.optimizer import AcceleratedOptimizer
    from accelerate_c.scheduler import AcceleratedScheduler
    acc = accelerate_c.Accelerator()
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.AdamW(model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    dl = torch.utils.data.DataLoader(list(range(4)), batch_size=2)
    s2, d2, m2, o2 = acc.prepare(sched, dl, model, opt)
    assert isinstance(s2, AcceleratedScheduler) and isinstance(o2, AcceleratedOptimizer)
    assert isinstance(m2, torch.nn.Module) and [b.tolist() for b in d2] == [[0, 1], [2, 3]]
    assert acc.prepare(m2) is m2  # no double wrapping


def test_bf16_autocast_forward_returns_fp32():
    import accelerate_c
    acc = accelerate_c.Accelerator(mixed_precision="bf16")
    model = acc.prepare(torch.nn.Linear(4, 4))
    out = model(torch.randn(2, 4))
    assert out.dtype == torch.float32
    with acc.autocast():
        assert torch.nn.functional.linear(torch.randn(2, 4), torch.randn(4, 4)).dtype == torch.bfloat16
    plain = acc.unwrap_model(model, keep_fp32_wrapper=False)
    assert not getattr(plain, "_accelerate_c_autocast", False)


def test_c_base_type_do_sync():
    from accelerate_c import _C
    a = _C.Accelerator()
    a._gradient_accumulation_steps = 3
    assert [a._do_sync(False) for _ in range(6)] == [False, False, True, False, False, True]
    a.step = 1
    assert a._do_sync(True) is True and a.step == 0  # end of dataloader forces a sync and resets
    a._gradient_accumulation_steps = 0
    with pytest.raises(ValueError, match="gradient_accumulation_steps"):
        a._do_sync(False)


def test_trigger_and_split_single_process():
    import accelerate_c
    acc = accelerate_c.Accelerator()
    assert acc.check_trigger() is False
    acc.set_trigger()
    assert acc.check_trigger() is True and acc.check_trigger() is False
    with acc.split_between_processes([1, 2, 3]) as part:
        assert part == [1, 2, 3]


def _split_as(state_cls, rank, world, inputs, padding):
    """split_between_processes of state_cls as rank `rank` of `world`, without a process group."""
    state = object.__new__(state_cls)
    state.__dict__ = {"num_processes": world, "process_index": rank, "device": torch.device("cpu")}
    try:
        with state.split_between_processes(inputs, apply_padding=padding) as part:
            pass
    except Exception as exc:  # an error is part of the behaviour compared
        return type(exc).__name__
    if type(part).__name__ == "Dataset":
        return ("dataset", part.to_list())
    return part.tolist() if isinstance(part, torch.Tensor) else part


@pytest.mark.parametrize("padding", [False, True])
def test_split_between_processes_as_hf(padding):
    """Every rank's share of lists, tuples, tensors, dicts and datasets.Dataset (0..5 items, 2 and 3
    ranks) equals HF's; datasets were not split or padded like HF's before (HF's test_script failed)."""
    import copy
    import datasets
    import accelerate.state as hf
    import accelerate_c.runtime.state as ours
    for world in (2, 3):
        for n in range(6):
            cases = [list(range(n)), tuple(range(n)), {"a": list(range(n)), "b": torch.arange(n).tolist()},
                     datasets.Dataset.from_list([dict(k=v) for v in range(n)])]
            if not padding:
                cases.append(torch.arange(n))  # HF pads tensors across processes (collective)
            for inputs in cases:
                for rank in range(world):
                    want = _split_as(hf.PartialState, rank, world, copy.deepcopy(inputs), padding)
                    got = _split_as(ours.PartialState, rank, world, copy.deepcopy(inputs), padding)
                    if want == "TypeError" and isinstance(inputs, tuple):
                        want = tuple(_split_as(hf.PartialState, rank, world, list(inputs), padding))  # HF: tuple + list
                    assert got == want, (world, n, rank, type(inputs).__name__)


def test_reset_state_error_text():
    from accelerate_c.state import AcceleratorState
    import accelerate_c
    acc = accelerate_c.Accelerator()
    AcceleratorState._reset_state(True)
    with pytest.raises(AttributeError, match=r"This happens if `AcceleratorState._reset_state\(\)` was called"):
        acc.state.device


def _sync_sequence(mod_name: str, with_dataloader: int, each_batch: int) -> list:
    """Per micro-step sync_gradients, accelerator.step and whether the optimizer really stepped, over two epochs of
    a loader whose length (5) does not divide by the accumulation steps (3)."""
    mod, utils = importlib.import_module(mod_name), importlib.import_module(f"{mod_name}.utils")
    plugin = utils.GradientAccumulationPlugin(num_steps=3, sync_with_dataloader=bool(with_dataloader),
                                              sync_each_batch=bool(each_batch))
    acc = mod.Accelerator(cpu=True, gradient_accumulation_plugin=plugin)
    try:
        torch.manual_seed(0)
        model = torch.nn.Linear(2, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(5, 2)), batch_size=1)
        model, opt, loader = acc.prepare(model, opt, loader)
        seq = []
        for _epoch in range(2):
            for (x,) in loader:
                before = model.weight.detach().clone()
                with acc.accumulate(model):
                    acc.backward(model(x).sum())
                    opt.step()
                    opt.zero_grad()
                seq.append((bool(acc.sync_gradients), int(acc.step), not torch.equal(before, model.weight.detach())))
        return seq
    finally:
        reset_state(mod_name)


@pytest.mark.parametrize("with_dataloader,each_batch", [(1, 0), (0, 0), (0, 1)])
def test_gradient_accumulation_plugin_options_as_hf(with_dataloader, each_batch):
    """sync_with_dataloader=False: the end of the loader does not force a sync; the step counter runs on across
    epochs (HF 1.15's _do_sync). Compared per micro-step with HF on the same run."""
    ours = _sync_sequence("accelerate_c", with_dataloader, each_batch)
    hf = _sync_sequence("accelerate", with_dataloader, each_batch)
    assert ours == hf
    assert len(ours) == 10
    if not with_dataloader:  # 5 batches, 3 accumulation steps: the loader's end never syncs by itself
        assert [s for s, _, _ in ours] == [(i + 1) % 3 == 0 for i in range(10)]


def test_strategy_registry_does_not_depend_on_import_order():
    """Importing one backend module first used to leave the registry with only that file's strategies, so a later
    single-process Accelerator found none."""
    import subprocess
    import sys

    from conftest import ROOT, clean_env
    code = ("import accelerate_c.strategies.ddp_bucketed\n"
            "from accelerate_c import Accelerator\n"
            "print(Accelerator(cpu=True).strategy.name)\n")
    proc = subprocess.run([sys.executable, "-c", code], env=clean_env(), cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and proc.stdout.split() == ["single"], proc.stdout + proc.stderr


# -- feature probes: what HF 1.15 answers when DeepSpeed/FSDP/Megatron/parallelism/fp8 are not in use ------------
_STATE_PROBES = ["deepspeed_plugin", "deepspeed_plugins", "parallelism_config", "device_mesh", "is_fsdp2",
                 "torch_tp_plugin"]
_ACC_PROBES = ["deepspeed_plugin", "parallelism_config", "torch_device_mesh", "is_fsdp2",
               "is_composable_parallelism_enabled", "fp8_enabled", "should_save_model", "tensor_parallel_rank",
               "data_parallel_rank", "data_parallel_shard_rank", "pipeline_parallel_rank", "context_parallel_rank"]


def _answer(get):
    try:
        value = get()
    except Exception as e:  # noqa: BLE001 - HF's error is part of the answer
        return ("raises", type(e).__name__, str(e))
    return ("value", getattr(value, "value", value))


def _probes(mod_name, **kwargs):
    mod = importlib.import_module(mod_name)
    acc = mod.Accelerator(cpu=True, **kwargs)
    st = mod.state.AcceleratorState()
    got = {f"state.{n}": _answer(lambda n=n: getattr(st, n)) for n in _STATE_PROBES}
    got.update({f"acc.{n}": _answer(lambda n=n: getattr(acc, n)) for n in _ACC_PROBES})
    got["state.get_deepspeed_plugin"] = _answer(lambda: st.get_deepspeed_plugin("default"))
    got["acc.fp8_backend"] = _answer(lambda: acc.fp8_backend)
    got["state.dynamo_plugin"] = _answer(lambda: st.dynamo_plugin.to_dict())
    # HF leaves these unset (AttributeError); ours are None: the same for getattr(state, name, None) checks
    got["unset_plugins"] = [getattr(st, n, None) for n in ("fsdp_plugin", "megatron_lm_plugin")]
    reset_state(mod_name)
    return got


def test_probes_match_hf():
    ours, hf = _probes("accelerate_c"), _probes("accelerate")
    assert ours == hf
    assert ours["acc.deepspeed_plugin"] == ("value", None) and ours["acc.is_fsdp2"] == ("value", False)
    assert ours["acc.tensor_parallel_rank"][:2] == ("raises", "RuntimeError")
    assert ours["acc.fp8_backend"] == ("value", "NO")


def test_probes_with_dynamo_backend_match_hf():
    assert _probes("accelerate_c", dynamo_backend="eager") == _probes("accelerate", dynamo_backend="eager")


def test_probes_with_fsdp_plugin_match_hf(monkeypatch):
    """One process with an FSDP2 plugin: HF keeps distributed_type NO (fsdp_plugin unset, is_fsdp2 False); so do we
    (the plugin still reaches the strategy's config). Both libraries set ACCELERATE_USE_FSDP: restored after."""
    import accelerate
    import accelerate_c
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "false")
    ours = _probes("accelerate_c", fsdp_plugin=accelerate_c.utils.FullyShardedDataParallelPlugin(fsdp_version=2))
    hf = _probes("accelerate", fsdp_plugin=accelerate.utils.FullyShardedDataParallelPlugin(fsdp_version=2))
    assert ours == hf and ours["acc.is_fsdp2"] == ("value", False)


def test_unset_plugins_are_none_and_bad_parallel_objects_refused():
    import accelerate_c
    acc = accelerate_c.Accelerator(cpu=True)
    assert acc.state.fsdp_plugin is None and acc.state.megatron_lm_plugin is None
    reset_state("accelerate_c")
    for kwarg, cls in (("megatron_lm_plugin", "MegatronLMPlugin"), ("parallelism_config", "ParallelismConfig")):
        with pytest.raises(TypeError, match=f"must be a {cls} object"):
            accelerate_c.Accelerator(cpu=True, **{kwarg: object()})
        reset_state("accelerate_c")


def test_fp8_probes(monkeypatch):
    import accelerate_c
    from accelerate_c.utils.dataclasses import FP8BackendType
    acc = accelerate_c.Accelerator(cpu=True, mixed_precision="fp8")
    assert acc.fp8_enabled and acc.fp8_backend == FP8BackendType.NO and not acc.has_fp8_handler
    monkeypatch.setenv("ACCELERATE_FP8_BACKEND", "te")
    assert acc.fp8_backend == FP8BackendType.TE
    monkeypatch.setenv("ACCELERATE_FP8_BACKEND", "bogus")
    with pytest.raises(ValueError, match="unknown fp8 backend 'bogus'"):
        acc.fp8_backend


def test_free_memory_releases_prepared_objects():
    import weakref
    import accelerate_c
    acc = accelerate_c.Accelerator(cpu=True)
    model = acc.prepare(torch.nn.Linear(2, 2))
    ref = weakref.ref(model)
    assert acc.free_memory(model) == [None] and acc._models == [] and acc.step == 0
    del model
    assert ref() is None


def test_subpackages_reachable_as_attributes_in_a_fresh_interpreter():
    """`import accelerate; accelerate.utils.X` works with HF's package; ours raised AttributeError unless something
    had imported accelerate_c.utils before (the suite's order hid it)."""
    import subprocess
    import sys
    code = "import accelerate_c; print(accelerate_c.utils.FullyShardedDataParallelPlugin.__name__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "FullyShardedDataParallelPlugin", out.stderr[-2000:]


@pytest.mark.parametrize("with_scaler", [False, True])
def test_a_hand_built_accelerated_optimizer_steps_like_hfs(with_scaler):
    """AcceleratedOptimizer(optimizer, device_placement, scaler), HF's positional signature, built by hand (an
    Accelerator exists, as HF requires): 3 AdamW steps give HF's weights and scale. Before, its step failed
    (the hand-built wrapper's strategy had no process state) and the second positional argument was taken as our
    precision object."""
    out = {}
    for mod_name in ("accelerate", "accelerate_c"):
        mod = importlib.import_module(mod_name)
        mod.Accelerator(cpu=True)
        wrapper = importlib.import_module(f"{mod_name}.optimizer").AcceleratedOptimizer
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 1)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16) if with_scaler else None
        opt = wrapper(torch.optim.AdamW(model.parameters(), lr=0.1), True, scaler)
        for _ in range(3):
            loss = model(torch.randn(8, 4)).pow(2).mean()
            (scaler.scale(loss) if scaler else loss).backward()
            opt.step()
            opt.zero_grad()
        out[mod_name] = (model.weight.detach().clone(), scaler.get_scale() if scaler else None)
        reset_state(mod_name)
    assert torch.allclose(out["accelerate"][0], out["accelerate_c"][0], atol=1e-6)
    assert out["accelerate"][1] == out["accelerate_c"][1]
