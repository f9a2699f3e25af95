# tests/test_device.py: the device decisions of the GPU path, on a CPU-only machine: which device PartialState picks
# (CUDA, MPS, CPU, an unsupported accelerator) and which process-group backend, with torch's availability probes
# monkeypatched (no GPU is touched: only the decisions are checked); pinned memory in a prepared loader; the device
# generators in a checkpoint's RNG states (saved and restored through the Accelerator, with fake CUDA generators).
# Not for: the C binding's device gate (tests/test_device_gate.py) or anything that needs a real GPU
# (benchmarks/gpu_check.py).
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from accelerate_c.base import imports
from accelerate_c.base.dataclasses import DistributedType
from accelerate_c.runtime import device as devmod
from accelerate_c.runtime.state import AcceleratorState, PartialState


@pytest.fixture
def no_accelerators(monkeypatch):
    """A machine with nothing but a CPU, whatever this one has; tests then add what they need."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(devmod, "mps_available", lambda: False)
    for attr, _ in devmod._UNSUPPORTED:
        monkeypatch.setattr(imports, f"is_{attr}_available", lambda check_device=False: False)
    monkeypatch.setattr(imports, "is_torch_xla_available", lambda *a, **k: False)
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "ACCELERATE_USE_CPU"):
        monkeypatch.delenv(var, raising=False)
    AcceleratorState._reset_state(True)
    yield monkeypatch
    AcceleratorState._reset_state(True)


def _gpus(mp, n: int) -> None:
    mp.setattr(torch.cuda, "is_available", lambda: True)
    mp.setattr(torch.cuda, "device_count", lambda: n)


def test_select_device_order(no_accelerators):
    mp = no_accelerators
    assert devmod.select_device(False, 0, False) == torch.device("cpu")
    mp.setattr(devmod, "mps_available", lambda: True)
    assert devmod.select_device(False, 0, False) == torch.device("mps")
    with pytest.raises(NotImplementedError, match="several processes on MPS"):
        devmod.select_device(False, 1, True)
    _gpus(mp, 2)  # CUDA first, then MPS (a GPU machine has no MPS; the order only matters for the decision)
    assert devmod.select_device(False, 0, False) == torch.device("cuda")  # HF: the index-less device
    assert devmod.select_device(False, 3, True) == torch.device("cuda", 1)  # LOCAL_RANK modulo the visible GPUs
    assert devmod.select_device(True, 3, True) == torch.device("cpu")


@pytest.mark.parametrize("probe, name", [("is_npu_available", "NPU"), ("is_xpu_available", "XPU"),
                                         ("is_torch_xla_available", "XLA")])
def test_unsupported_accelerator_is_named(no_accelerators, probe, name):
    no_accelerators.setattr(imports, probe, lambda *a, **k: True)
    with pytest.raises(NotImplementedError, match=f"accelerator is {name}.*cpu=True"):
        PartialState()
    AcceleratorState._reset_state(True)
    assert PartialState(cpu=True).device == torch.device("cpu")  # the way out the message names
    AcceleratorState._reset_state(True)
    no_accelerators.setenv("ACCELERATE_USE_CPU", "1")
    assert PartialState().device == torch.device("cpu")


def test_single_process_on_a_gpu(no_accelerators):
    _gpus(no_accelerators, 1)
    st = PartialState()
    assert st.device == torch.device("cuda") and st.distributed_type == DistributedType.NO
    assert st.default_device == torch.device("cuda")
    AcceleratorState._reset_state(True)
    st = PartialState(cpu=True)
    assert st.device == torch.device("cpu") and st.default_device == torch.device("cpu")


class _FakeDist:
    """torch.distributed's calls PartialState makes, recorded instead of made."""

    def __init__(self, mp, world: int, rank: int) -> None:
        self.calls: list = []
        self.backend = None
        mp.setattr(dist, "is_initialized", lambda: self.backend is not None)
        mp.setattr(dist, "init_process_group", self.init)
        mp.setattr(dist, "get_backend", lambda *a: self.backend)
        mp.setattr(dist, "get_world_size", lambda *a: world)
        mp.setattr(dist, "get_rank", lambda *a: rank)
        mp.setattr(torch.cuda, "set_device", lambda d: self.calls.append(("set_device", torch.device(d))))

    def init(self, backend=None, **kwargs):
        self.calls.append(("init", backend))
        self.backend = backend


@pytest.mark.parametrize("asked, backend", [(None, "nccl"), ("nccl", "nccl"), ("gloo", "gloo")])
def test_two_processes_on_one_gpu(no_accelerators, asked, backend):
    """Rank 1 of 2 on a machine with one GPU: cuda:0 for both (the gloo-on-CUDA check of the GPU script), NCCL
    unless another backend is asked for, MULTI_GPU."""
    mp = no_accelerators
    _gpus(mp, 1)
    fake = _FakeDist(mp, 2, 1)
    for k, v in {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1", "MASTER_PORT": "1"}.items():
        mp.setenv(k, v)
    st = PartialState(init_kwargs={"backend": asked} if asked else {})
    assert fake.calls == [("set_device", torch.device("cuda", 0)), ("init", backend)]
    assert st.device == torch.device("cuda", 0) and st.backend == backend
    assert st.distributed_type == DistributedType.MULTI_GPU and st.process_index == 1


def test_backend_without_a_gpu(no_accelerators):
    assert devmod.default_backend(torch.device("cpu"), None) == "gloo"
    assert devmod.default_backend(torch.device("cpu"), "nccl") == "gloo"  # HF's kwargs default: nccl
    assert devmod.default_backend(torch.device("cuda", 0), None) == "nccl"
    assert devmod.default_backend(torch.device("cuda", 0), "gloo") == "gloo"


@pytest.mark.parametrize("device, non_blocking, pin, want", [
    ("cuda", True, False, True), ("cuda", False, False, False), ("cpu", True, False, False), ("cpu", False, True, True),
    (None, True, False, False)])
def test_prepared_loader_pins_for_cuda(no_accelerators, device, non_blocking, pin, want):
    """A loader whose batches go to a CUDA device with non_blocking=True pins its memory (nothing is iterated: the
    pinning thread starts only when a batch is fetched)."""
    from accelerate_c.data.prepare import prepare_data_loader
    PartialState(cpu=True)
    dl = DataLoader(list(range(8)), batch_size=2, pin_memory=pin)
    out = prepare_data_loader(dl, torch.device(device) if device else None, put_on_device=device is not None,
                              non_blocking=non_blocking)
    assert out.pin_memory is want


class _FakeCudaRng:
    """Two CUDA generators that exist only as states: what rng.py saves and restores."""

    def __init__(self, mp) -> None:
        self.states = [torch.arange(16, dtype=torch.uint8), torch.arange(16, 32, dtype=torch.uint8)]
        self.restored: dict = {}
        _gpus(mp, 2)
        mp.setattr(torch.cuda, "is_initialized", lambda: True)
        mp.setattr(torch.cuda, "get_rng_state_all", lambda: [s.clone() for s in self.states])
        mp.setattr(torch.cuda, "set_rng_state", lambda s, i: self.restored.__setitem__(i, s.clone()))


def test_rng_states_per_device_in_checkpoints(no_accelerators, tmp_path):
    """A checkpoint taken where CUDA is in use holds every device generator's state; loading it restores each on its
    device. The Accelerator runs on the CPU (cpu=True) while torch.cuda answers as a machine with two GPUs would."""
    from accelerate_c import Accelerator
    fake = _FakeCudaRng(no_accelerators)
    acc = Accelerator(cpu=True)
    acc.save_state(str(tmp_path / "ckpt"))
    saved = fake.states
    fake.states = [torch.zeros(16, dtype=torch.uint8)] * 2  # the generators move on
    acc.load_state(str(tmp_path / "ckpt"))
    assert sorted(fake.restored) == [0, 1]
    for i in (0, 1):
        assert torch.equal(fake.restored[i], saved[i])


def test_rng_states_without_the_device(no_accelerators, tmp_path):
    """Saved with CUDA in use, loaded where there is none: the host generators come back, the CUDA ones are skipped."""
    from accelerate_c.checkpointing.rng import rng_state, set_rng_state
    mp = no_accelerators
    _FakeCudaRng(mp)
    states = rng_state()
    assert len(states["cuda"]) == 2
    torch.manual_seed(0)
    expect = torch.rand(3)
    torch.manual_seed(0)
    states = {**states, "torch": torch.get_rng_state()}
    mp.setattr(torch.cuda, "is_available", lambda: False)
    mp.setattr(torch.cuda, "set_rng_state", lambda *a: pytest.fail("no CUDA generator may be touched"))
    torch.rand(5)
    set_rng_state(states)
    assert torch.equal(torch.rand(3), expect)
    assert "cuda" not in rng_state() and os.environ.get("ACCELERATE_USE_CPU") is None


@pytest.mark.parametrize("cap, rows, k, n, want", [((9, 0), 32, 64, 48, True), ((8, 9), 16, 16, 16, True),
                                                  ((8, 0), 32, 64, 48, False), ((9, 0), 24, 64, 48, False),
                                                  ((9, 0), 32, 72, 48, False), ((9, 0), 32, 64, 40, False)])
def test_fp8_uses_scaled_mm_where_the_device_has_it(monkeypatch, cap, rows, k, n, want):
    """FP8Linear's forward takes torch._scaled_mm on CUDA devices of capability 8.9+ with every dimension a multiple
    of 16 (cuBLASLt's fp8 GEMM rule), the emulation elsewhere; decided without a GPU (a stand-in input)."""
    from types import SimpleNamespace
    from accelerate_c.precision import fp8
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: cap)
    x = SimpleNamespace(is_cuda=True, shape=(rows, k), device="cuda:0")
    assert fp8._use_scaled_mm(x, SimpleNamespace(shape=(n, k))) is want
    assert fp8._use_scaled_mm(torch.zeros(32, 64), torch.zeros(48, 64)) is False


def test_accelerate_torch_device_wins(no_accelerators):
    # HF's ACCELERATE_TORCH_DEVICE sets the device whatever the probes say (it was ignored: MPS was picked)
    no_accelerators.setattr(devmod, "mps_available", lambda: True)
    assert PartialState().device == torch.device("mps")
    AcceleratorState._reset_state(True)
    no_accelerators.setenv("ACCELERATE_TORCH_DEVICE", "cpu")
    assert PartialState().device == torch.device("cpu")


def test_init_process_group_keywords_given_to_the_state(no_accelerators, tmp_path):
    # HF documents `PartialState(**InitProcessGroupKwargs(...).to_kwargs())`: the keywords reach init_process_group
    # (they were dropped: timeout 1800 s and init_method None whatever was given). AcceleratorState's own keywords
    # (the parallel settings) never reach it.
    from datetime import timedelta

    from conftest import free_port
    mp = no_accelerators
    seen = []
    real = dist.init_process_group

    def record(**kw):
        seen.append(kw)
        real(backend=kw["backend"], init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
             timeout=kw["timeout"])

    mp.setattr(dist, "init_process_group", record)
    for var, value in (("WORLD_SIZE", "2"), ("RANK", "0"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29500")):
        mp.setenv(var, value)  # (restored afterwards, the two the state would set by default included)
    try:
        AcceleratorState(cpu=True, timeout=timedelta(seconds=7), init_method="env://", backend="gloo",
                         parallelism_config=None, torch_tp_plugin=None, megatron_lm_plugin=None)
        assert seen == [dict(backend="gloo", init_method="env://", rank=0, world_size=2,
                             timeout=timedelta(seconds=7))], seen
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
