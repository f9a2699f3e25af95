# tests/test_utils_api.py: HF's utilities under accelerate_c.utils, each run side by side with HF Accelerate 1.15's
# own on the same inputs: find_executable_batch_size (tried sizes, real CPU allocator errors, its errors, memory
# freed between tries), release_memory, patch/clear_environment, tqdm, extract_model_from_parallel (our DDP
# wrapper, torch DDP, torch.compile, the mixed-precision forward patch), save/load.
# Not for: multi-process behaviour (test_launchers.py runs tqdm/save/unwrap on 2 ranks), dynamo (test_dynamo.py).
import collections
import importlib
import os
import weakref

import numpy as np
import pytest
import torch

import accelerate.utils as hf_utils
import accelerate_c
import accelerate_c.utils as ac_utils
from conftest import reset_state


pytestmark = pytest.mark.usefixtures("clean_state")


def test_hf_names_are_exported():
    assert ac_utils.clear_device_cache is not None  # HF's lives in accelerate.utils.memory only
    for name in ("find_executable_batch_size", "release_memory", "tqdm", "save", "load",
                 "extract_model_from_parallel", "patch_environment", "clear_environment", "FP8BackendType",
                 "TorchDynamoPlugin", "compile_regions", "is_compiled_module"):
        assert callable(getattr(ac_utils, name)), name
        assert hasattr(hf_utils, name) or hasattr(hf_utils.dataclasses, name), f"{name} is not an HF name"
    assert accelerate_c.find_executable_batch_size is ac_utils.find_executable_batch_size
    assert callable(ac_utils.tqdm) and not isinstance(ac_utils.tqdm, type(os)), "utils.tqdm must be the function"


def test_every_public_name_of_hfs_accelerator_states_and_package_exists():
    """Every public attribute of HF 1.15's Accelerator, PartialState, AcceleratorState, GradientState and top-level
    package exists on ours. Before, verify_device_map, maybe_context_parallel, deepspeed_ulysses_dl_adapter,
    lomo_backward, set_device, prepare_pippy, is_rich_available and GradientState.is_xla_gradients_synced were
    missing."""
    import accelerate
    import accelerate.state as hf_state

    import accelerate_c.state as ac_state

    pairs = [(accelerate.Accelerator, accelerate_c.Accelerator), (accelerate, accelerate_c)]
    pairs += [(getattr(hf_state, c), getattr(ac_state, c)) for c in ("PartialState", "AcceleratorState")]
    for hf, ours in pairs:
        missing = [n for n in dir(hf) if not n.startswith("_") and not hasattr(ours, n)]
        assert not missing or missing == ["fork_launched"], (hf, missing)  # (ours: an attribute of the instance)
    assert {n for n in dir(hf_state.GradientState) if not n.startswith("_")} <= set(dir(ac_state.GradientState))
    hf_grad, ac_grad = hf_state.GradientState(), ac_state.GradientState()
    assert ac_grad.is_xla_gradients_synced is False and hf_grad.is_xla_gradients_synced is False
    ac_grad.is_xla_gradients_synced = True
    assert ac_state.GradientState().is_xla_gradients_synced is True  # shared, as HF's
    ac_grad.is_xla_gradients_synced = False
    for probe in ("is_4bit_bnb_available", "is_8bit_bnb_available", "is_bitsandbytes_multi_backend_available",
                  "is_transformer_engine_mxfp8_available", "is_xccl_available", "is_habana_gaudi1",
                  "is_import_timer_available", "is_amdsmi_available", "is_rocm_available", "is_pippy_available"):
        assert bool(getattr(ac_utils, probe)()) == bool(getattr(hf_utils, probe)()), probe


def _params(f) -> dict:
    import inspect
    try:
        return {p.name: p for p in inspect.signature(f).parameters.values()
                if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    except (TypeError, ValueError):
        return None  # (no signature to read)


def test_every_keyword_of_hfs_functions_and_methods_is_accepted():
    """For each function of HF's accelerate.utils that ours has, and each method of the Accelerator and the states,
    every parameter of HF's signature exists in ours (a caller's keyword must not be a TypeError). Before,
    str_to_bool(to_bool=), is_bnb_available(min_version=) and is_hpu_available(init_hccl=) were missing."""
    import accelerate
    import accelerate.state as hf_state

    import accelerate_c.state as ac_state

    pairs = [(getattr(hf_utils, n), getattr(ac_utils, n)) for n in dir(hf_utils)
             if not n.startswith("_") and n in dir(ac_utils) and callable(getattr(hf_utils, n))
             and not isinstance(getattr(hf_utils, n), type)]
    for hf_cls, ours_cls in [(accelerate.Accelerator, accelerate_c.Accelerator)] + [
            (getattr(hf_state, c), getattr(ac_state, c)) for c in ("PartialState", "AcceleratorState", "GradientState")]:
        pairs += [(getattr(hf_cls, n), getattr(ours_cls, n)) for n in dir(hf_cls)
                  if (not n.startswith("_") or n == "__init__") and hasattr(ours_cls, n)
                  and callable(getattr(hf_cls, n)) and not isinstance(getattr(hf_cls, n), type)]
    sigs = [(hf, _params(hf), _params(ours)) for hf, ours in pairs]
    missing = [(getattr(hf, "__qualname__", hf), sorted(set(h) - set(o) - {"self"}))
               for hf, h, o in sigs if h is not None and o is not None and set(h) - set(o) - {"self"}]
    assert not missing, missing
    assert ac_utils.str_to_bool("Yes", to_bool=True) is hf_utils.str_to_bool("Yes", to_bool=True) is True
    assert ac_utils.str_to_bool("off") == hf_utils.str_to_bool("off") == 0
    assert ac_utils.is_safetensors_available() and ac_utils.is_safetensors_available(min_version="0.1")
    assert not ac_utils.is_safetensors_available(min_version="999.0")


@pytest.mark.parametrize("mode", ["no", "bf16", "fp16"])
def test_standalone_precision_and_storage_helpers_match_hf(mode, caplog):
    """get_mixed_precision_context_manager, get_grad_scaler, id_tensor_storage, model_has_dtensor and
    check_tied_parameters_on_same_device (missing before) against HF's, in each mixed-precision mode. One deliberate
    difference: on a CPU machine HF's get_grad_scaler returns a CUDA scaler, disabled; ours scales on the CPU."""
    results = {}
    for lib, utils in (("accelerate", hf_utils), ("accelerate_c", ac_utils)):
        reset_state(lib)
        importlib.import_module(lib).Accelerator(cpu=True, mixed_precision=mode)
        x = torch.randn(4, 4)
        with utils.get_mixed_precision_context_manager(native_amp=mode != "no"):
            dtype = (x @ x).dtype
        scaler = utils.get_grad_scaler()
        base = torch.zeros(8)
        ids = [utils.id_tensor_storage(t) for t in (base, base[2:], torch.zeros(8))]
        caplog.clear()
        utils.check_tied_parameters_on_same_device([["a.weight", "b.weight"]], {"a": "cpu", "b": "disk"})
        assert scaler.is_enabled() == (lib == "accelerate_c")
        results[lib] = (dtype, type(scaler).__name__, ids[0] == ids[1], ids[0] == ids[2],
                        utils.model_has_dtensor(torch.nn.Linear(2, 2)),
                        any("Tied parameters are on different devices" in r.message for r in caplog.records))
        reset_state(lib)
    assert results["accelerate"] == results["accelerate_c"], results


def test_features_accelerate_c_does_not_run_behave_as_hfs_when_off(caplog):
    acc = accelerate_c.Accelerator(cpu=True)
    loader = [1, 2]
    assert acc.deepspeed_ulysses_dl_adapter(loader, None) is loader
    with acc.maybe_context_parallel(buffers=[torch.zeros(2, 4)], buffer_seq_dims=[1]):
        pass
    with pytest.raises(ValueError, match="A learning rate must be passed"):
        acc.lomo_backward(torch.zeros(()), None)
    with pytest.raises(ValueError, match="Are you sure you passed a LOMO optimizer"):
        acc.lomo_backward(torch.zeros(()), 1e-3)
    state = accelerate_c.PartialState()
    device = state.device
    state.set_device()
    assert state.device == device


# ---------------------------------------------------------------------------------------- find_executable_batch_size
def _oom_trace(utils, start: int, limit: int, message: str, **kw) -> tuple:
    tried = []

    @utils.find_executable_batch_size(starting_batch_size=start, **kw)
    def run(batch_size, scale):
        tried.append(batch_size)
        if batch_size > limit:
            raise RuntimeError(message)
        return batch_size * scale

    return run(3), tried


@pytest.mark.parametrize("message", ["CUDA out of memory. Tried to allocate 2.00 GiB", "MPS backend out of memory",
                                     "DefaultCPUAllocator: can't allocate memory: you tried to allocate 1 bytes"])
def test_batch_size_search_matches_hf(message):
    # every retry collects garbage: the full 128 -> 40 search once, a short one for the other messages
    limit = 40 if message.startswith("CUDA") else 110
    ours, hf = _oom_trace(ac_utils, 128, limit, message), _oom_trace(hf_utils, 128, limit, message)
    assert ours == hf and ours[1][0] == 128 and ours[1][-1] <= limit and len(ours[1]) >= 2


def test_custom_reduce_fn_matches_hf():
    def halving(utils):
        box = {"bs": 100}

        def reduce():
            box["bs"] //= 2
            return box["bs"]
        return _oom_trace(utils, 100, 10, "CUDA out of memory.", reduce_batch_size_fn=reduce)

    assert halving(ac_utils) == halving(hf_utils) == (18, [100, 50, 25, 12, 6])


def test_real_cpu_allocator_error_is_retried():
    def trace(utils):
        tried = []

        @utils.find_executable_batch_size(starting_batch_size=64)
        def run(batch_size):
            tried.append(batch_size)
            if batch_size > 50:
                torch.empty(2 ** 50, dtype=torch.uint8)  # the real DefaultCPUAllocator failure
            return batch_size
        return run(), tried

    assert trace(ac_utils) == trace(hf_utils) == (45, [64, 57, 51, 45])


def _error(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - compared below
        return type(e).__name__, str(e)
    return None


def test_batch_size_errors_match_hf():
    def cases(utils):
        def always_oom(batch_size):
            raise RuntimeError("CUDA out of memory.")

        def other_error(batch_size):
            raise RuntimeError("shape mismatch")

        def value_error(batch_size):
            raise ValueError("bad value")

        def two_args(batch_size, model):
            return batch_size

        return [_error(lambda: utils.find_executable_batch_size(always_oom, starting_batch_size=4)()),
                _error(lambda: utils.find_executable_batch_size(other_error)()),
                _error(lambda: utils.find_executable_batch_size(value_error)()),
                _error(lambda: utils.find_executable_batch_size(two_args)(16, "model"))]

    ours, hf = cases(ac_utils), cases(hf_utils)
    assert ours == hf
    assert ours[0] == ("RuntimeError", "No executable batch size found, reached zero.")
    assert ours[1] == ("RuntimeError", "shape mismatch") and ours[2] == ("ValueError", "bad value")
    assert ours[3][0] == "TypeError" and "two_args(model=model)" in ours[3][1]


class _Cycle:
    def __init__(self):
        self.me = self
        self.payload = torch.zeros(1024)


def test_failed_try_is_freed_before_the_next_one():
    seen = []

    @ac_utils.find_executable_batch_size(starting_batch_size=8)
    def run(batch_size):
        seen.append([r() is None for r in refs])  # were the earlier tries' objects collected?
        garbage = _Cycle()  # only a gc pass frees it (reference cycle), and the failed frame holds it
        refs.append(weakref.ref(garbage))
        if batch_size > 5:
            raise RuntimeError("CUDA out of memory.")
        return batch_size

    refs = []
    assert run() == 5
    assert seen == [[], [True], [True, True], [True, True, True]]


def test_release_memory_and_clear_device_cache():
    a, b = _Cycle(), torch.ones(3)
    ra = weakref.ref(a)
    out = ac_utils.release_memory(a, b)
    assert out == hf_utils.release_memory(1, 2) == [None, None]
    del a
    ac_utils.clear_device_cache(garbage_collection=True)
    assert ra() is None


# --------------------------------------------------------------------------------------------------- environment
def _env_story(utils) -> list:
    os.environ["AC_TEST_KEEP"] = "old"
    os.environ.pop("AC_TEST_NEW", None)
    seen = []
    with utils.patch_environment(ac_test_keep=1, AC_TEST_NEW=2.5):
        seen.append((os.environ["AC_TEST_KEEP"], os.environ["AC_TEST_NEW"]))
    seen.append((os.environ.get("AC_TEST_KEEP"), os.environ.get("AC_TEST_NEW")))
    with utils.clear_environment():
        seen.append(dict(os.environ))
        os.environ["AC_TEST_INSIDE"] = "x"
        os.environ["AC_TEST_KEEP"] = "changed"
    seen.append((os.environ.get("AC_TEST_INSIDE"), os.environ.get("AC_TEST_KEEP")))
    with pytest.raises(KeyError):
        with utils.patch_environment(ac_test_new="temp"):
            raise KeyError("inside")
    seen.append(os.environ.get("AC_TEST_NEW"))
    del os.environ["AC_TEST_KEEP"]
    return seen


def test_environment_context_managers_match_hf():
    ours, hf = _env_story(ac_utils), _env_story(hf_utils)
    assert ours == hf
    assert ours == [("1", "2.5"), ("old", None), {}, (None, "old"), None]


# ----------------------------------------------------------------------------------------------------------- tqdm
def test_tqdm_matches_hf_on_one_process():
    bar = ac_utils.tqdm(range(3), desc="x")
    assert not bar.disable and list(bar) == [0, 1, 2]
    assert ac_utils.tqdm(range(3), disable=True).disable
    assert ac_utils.tqdm(range(3), main_process_only=False).disable is False
    assert _error(lambda: ac_utils.tqdm(True, range(3))) == _error(lambda: hf_utils.tqdm(True, range(3)))
    assert _error(lambda: ac_utils.tqdm(True, range(3)))[0] == "ValueError"


# ----------------------------------------------------------------------------------------------------- unwrapping
def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))


def test_unwraps_our_data_parallel_wrapper():
    from accelerate_c.ddp.module import DataParallelModule

    net = _net()
    wrapped = DataParallelModule(net, sync=None, buffer_sync=None)
    assert ac_utils.extract_model_from_parallel(wrapped) is net
    assert hf_utils.extract_model_from_parallel(wrapped) is wrapped  # HF does not know it: that is why we own it


@pytest.fixture
def gloo_world_of_one(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.FileStore(str(tmp_path / "store"), 1))
    yield
    dist.destroy_process_group()


def test_unwraps_torch_ddp_like_hf(gloo_world_of_one):
    net = _net()
    ddp = torch.nn.parallel.DistributedDataParallel(net)
    assert ac_utils.extract_model_from_parallel(ddp) is hf_utils.extract_model_from_parallel(ddp) is net
    outer = torch.nn.Sequential(torch.nn.parallel.DistributedDataParallel(_net()))
    ours = ac_utils.extract_model_from_parallel(outer, recursive=True)
    assert isinstance(ours[0], torch.nn.Sequential), "recursive=True unwraps children too"


def test_compiled_models_unwrap_like_hf():
    def case(utils, keep):
        net = _net()
        compiled = torch.compile(torch.nn.DataParallel(net), backend="eager")
        out = utils.extract_model_from_parallel(compiled, keep_torch_compile=keep)
        return out is net, type(out).__name__, sorted(out.state_dict())

    for keep in (True, False):
        assert case(ac_utils, keep) == case(hf_utils, keep)
    assert case(ac_utils, False)[0] and case(ac_utils, True)[1] == "OptimizedModule"


@pytest.mark.parametrize("mod_name", ["accelerate_c", "accelerate"])
def test_keep_fp32_wrapper_false_removes_the_autocast_patch(mod_name):
    mod = importlib.import_module(mod_name)
    acc = mod.Accelerator(mixed_precision="bf16", cpu=True)
    net = _net()
    x = torch.randn(2, 3)
    plain = net(x)
    model = acc.prepare(net)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert model(x).dtype == torch.float32  # patched forward: autocast inside, fp32 out
        kept = acc.unwrap_model(model)
        assert kept(x).dtype == torch.float32
        unwrapped = acc.unwrap_model(model, keep_fp32_wrapper=False)
        assert unwrapped is net and unwrapped(x).dtype == torch.bfloat16  # the model's own forward again
    torch.testing.assert_close(unwrapped(x), plain)
    assert "_original_forward" not in net.__dict__


def test_accelerator_unwrap_model_is_extract_model_from_parallel(monkeypatch):
    calls = []
    monkeypatch.setattr("accelerate_c.accelerator.extract_model_from_parallel",
                        lambda *a: calls.append(a) or "unwrapped")
    acc = accelerate_c.Accelerator(cpu=True)
    net = _net()
    assert acc.unwrap_model(net, keep_fp32_wrapper=False, keep_torch_compile=False) == "unwrapped"
    assert calls == [(net, False, False)]


# -------------------------------------------------------------------------------------------------- save / load
def test_save_and_load_match_hf(tmp_path):
    shared = torch.arange(6.0)
    obj = collections.OrderedDict(a=shared, b=shared, c=torch.ones(2, 3).t())  # tied and non-contiguous
    from safetensors.torch import load_file

    for name, utils in (("ours", ac_utils), ("hf", hf_utils)):
        utils.save(obj, str(tmp_path / f"{name}.safetensors"), safe_serialization=True)
        utils.save({"x": np.random.get_state(), "t": torch.ones(2)}, str(tmp_path / f"{name}.pt"))  # an RNG state
    ours, hf = load_file(str(tmp_path / "ours.safetensors")), load_file(str(tmp_path / "hf.safetensors"))
    assert sorted(ours) == sorted(hf) == ["a", "c"]
    for k in ours:
        assert torch.equal(ours[k], hf[k])
    a, b = ac_utils.load(str(tmp_path / "hf.pt")), hf_utils.load(str(tmp_path / "ours.pt"))
    assert np.array_equal(a["x"][1], b["x"][1]) and a["x"][0] == "MT19937" and torch.equal(a["t"], b["t"])

    torch.save({"c": _Cycle()}, str(tmp_path / "custom.pt"))
    ours_err, hf_err = _error(lambda: ac_utils.load(str(tmp_path / "custom.pt"))), \
        _error(lambda: hf_utils.load(str(tmp_path / "custom.pt")))
    assert ours_err[0] == hf_err[0] == "UnpicklingError", "weights_only=True by default"


def test_save_rejects_a_non_dict_for_safetensors(tmp_path):
    with pytest.raises(TypeError, match="needs a dict of tensors, got a list"):
        ac_utils.save([torch.ones(1)], str(tmp_path / "x.safetensors"), safe_serialization=True)


def test_save_writes_on_the_main_process_only(tmp_path):
    state = accelerate_c.PartialState(cpu=True)
    for main, local_main in ((True, True), (False, True), (False, False)):
        state.process_index, state.local_process_index = (0 if main else 1), (0 if local_main else 1)
        for each_node in (False, True):
            path = tmp_path / f"{main}{local_main}{each_node}.pt"
            ac_utils.save([1], str(path), save_on_each_node=each_node)
            assert path.exists() == (local_main if each_node else main), (main, local_main, each_node)


def test_accelerator_save_honours_save_on_each_node(tmp_path, monkeypatch):
    from accelerate_c.utils.dataclasses import ProjectConfiguration

    acc = accelerate_c.Accelerator(cpu=True, project_config=ProjectConfiguration(save_on_each_node=True))
    calls = []
    monkeypatch.setattr("accelerate_c.utils.other.save", lambda *a, **k: calls.append((a, k)))
    acc.save({"a": 1}, "f.pt", safe_serialization=True)
    assert calls == [(({"a": 1}, "f.pt"), {"save_on_each_node": True, "safe_serialization": True})]
