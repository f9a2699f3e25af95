# tests/test_device_gate.py: no CPU kernel or shared-memory path ever receives a device tensor. The C binding's gate
# (csrc/tensor.c acc_tensor_borrow_cpu) turns a tensor on another device into a ValueError naming the argument and
# the device: tested with tensors whose DLPack device is CUDA or Metal (a DLPack producer made with ctypes: this
# machine has no GPU) and with torch's meta tensors (which DLPack cannot export at all). The Python dispatchers in
# front of the kernels (casts, gradient passes, the fused step, the sharded engine's copy-in, the comm groups) route
# such tensors away from C: tested with meta tensors.
# Not for: device selection (tests/test_device.py) or the CUDA kernels (tests/test_cuda_ext.py).
from __future__ import annotations

import ctypes

import pytest
import torch

from accelerate_c import _C

_CUDA, _METAL = 2, 8


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32), ("dtype", _DLDataType),
                ("shape", ctypes.POINTER(ctypes.c_int64)), ("strides", ctypes.POINTER(ctypes.c_int64)),
                ("byte_offset", ctypes.c_uint64)]


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p)]


_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]


class DeviceTensor:
    """A 1-D float32 tensor as DLPack describes one on another device: `__dlpack__` gives a "dltensor" capsule whose
    device is (device_type, device_id) and whose data pointer points at memory no kernel may touch (a CPU buffer here,
    so a gate that let it through would compute garbage instead of crashing: the test checks the error, not a
    crash)."""

    def __init__(self, n: int = 8, device_type: int = _CUDA, device_id: int = 0) -> None:
        self._keep = torch.zeros(n)
        self._shape = (ctypes.c_int64 * 1)(n)
        self._mt = _DLManagedTensor()
        dl = self._mt.dl_tensor
        dl.data, dl.device, dl.ndim = self._keep.data_ptr(), _DLDevice(device_type, device_id), 1
        dl.dtype, dl.shape, dl.strides = _DLDataType(2, 32, 1), self._shape, None
        self.device_type, self.device_id = device_type, device_id

    def __dlpack__(self, *args, **kwargs):
        return _capsule_new(ctypes.addressof(self._mt), b"dltensor", None)

    def __dlpack_device__(self):
        return (self.device_type, self.device_id)


def test_fake_producer_reads_as_its_device():
    assert _C.tensor_info(DeviceTensor(5, _CUDA, 1))[2:] == (5, True, _CUDA)


def _entry_points(x, cpu):
    """(name, call) for C entry points, each handed `x` in one argument and valid CPU tensors elsewhere."""
    f32 = torch.zeros(cpu.numel())
    return [
        ("cast src", lambda: _C.cast(x, torch.empty(f32.shape, dtype=torch.bfloat16), None, None, 1)),
        ("cast dst", lambda: _C.cast(f32, x, None, None, 1)),
        ("multi_scale_ tensors", lambda: _C.multi_scale_([f32, x], 2.0, None, 1)),
        ("multi_norm tensors", lambda: _C.multi_norm([x], 2.0, 1)),
        ("grads_nonfinite grads", lambda: _C.grads_nonfinite([x], 1.0, 1)),
        ("adam_step params", lambda: _C.adam_step([x], [f32], [f32.clone()], [f32.clone()], None, 1.0, None, 1e-3,
                                                  0.9, 0.999, 1e-8, 0.0, True, False, False, 1.0, 1, False)),
        ("adam_step grads", lambda: _C.adam_step([f32], [x], [f32.clone()], [f32.clone()], None, 1.0, None, 1e-3,
                                                 0.9, 0.999, 1e-8, 0.0, True, False, False, 1.0, 1, False)),
        ("sgd_step params", lambda: _C.sgd_step([x], [f32], None, None, None, 0.1, 0.0, 0.0, 0.0, False, False,
                                                1.0, 1)),
        ("pack dst", lambda: _C.pack(x, [f32], [0], 1)),
        ("pack srcs", lambda: _C.pack(f32.clone(), [x], [0], 1)),
        ("quantize_blockwise x", lambda: _C.quantize_blockwise(x, torch.empty(cpu.numel(), dtype=torch.uint8),
                                                               torch.empty(1), True, 1)),
    ]


@pytest.mark.parametrize("device_type, name", [(_CUDA, "cuda:0"), (_METAL, "mps:0")])
def test_c_gate_refuses_device_tensors(device_type, name):
    x = DeviceTensor(8, device_type)
    for what, call in _entry_points(x, torch.zeros(8)):
        arg = what.split()[1]
        with pytest.raises(ValueError, match=rf"{arg}.*expected a CPU tensor, got one on {name}"):
            call()


def test_c_gate_refuses_meta_tensors():
    """torch cannot export a meta tensor through DLPack (BufferError "Cannot pack tensors on meta"): the gate names
    the argument and the device instead."""
    m = torch.empty(8, device="meta")
    with pytest.raises(BufferError):
        m.__dlpack__()
    for what, call in _entry_points(m, torch.zeros(8)):
        with pytest.raises(ValueError, match=rf"{what.split()[1]}.*expected a CPU tensor, got one on meta"):
            call()


def test_shm_group_refuses_device_tensors():
    from accelerate_c.comm.shm import ShmGroup
    g = ShmGroup(timeout=20)
    try:
        for x, name in ((DeviceTensor(8), "cuda:0"), (torch.zeros(8, device="meta"), "meta")):
            with pytest.raises(ValueError, match=f"expected a CPU tensor, got one on {name}"):
                g.all_reduce(x) if isinstance(x, torch.Tensor) else _C.shm_all_reduce(g._h, x, 0)
    finally:
        g.close()


# ---- the Python side: device tensors never reach the CPU kernels ---------------------------------------------------


def test_dispatchers_route_meta_tensors_to_torch():
    from accelerate_c.optim.gradops import global_norm, non_finite_check_and_unscale_, scale_
    from accelerate_c.precision.cast import cast
    from accelerate_c.sharding.pack import pack
    m = torch.ones(8, device="meta")
    y, amax = cast(m, torch.float8_e4m3fn, scale=2.0, return_amax=True)
    assert y.device.type == "meta" and y.dtype == torch.float8_e4m3fn and amax.device.type == "meta"
    assert global_norm([m]).device.type == "meta"
    scale_([m], 0.5)
    non_finite_check_and_unscale_([m], torch.zeros(1, device="meta"), torch.ones(1, device="meta"))
    out = torch.empty(12, device="meta")
    pack(out, [0, 8], [m, None])  # torch copies: nothing to check on meta beyond "no C call"


def test_fused_step_declines_device_params():
    from accelerate_c.optim import fused_step
    p = torch.nn.Parameter(torch.ones(4, device="meta"))
    p.grad = torch.ones(4, device="meta")
    assert fused_step(torch.optim.AdamW([p])) is False
    assert fused_step(torch.optim.SGD([p], lr=0.1)) is False


def test_comm_groups_pick_torch_for_device_tensors(monkeypatch):
    """group_for_device: shared memory for CPU tensors only; an shm-backed group routes any other tensor (meta here)
    to torch.distributed on the same process group."""
    from accelerate_c.comm import group as groupmod

    class Inner:
        rank, size = 0, 1

        def all_reduce(self, t, op="sum"):
            raise AssertionError("a non-CPU tensor reached the shared-memory group")

    class Torch:
        def __init__(self, pg):
            self.seen = []

        def all_reduce(self, t, op="sum"):
            self.seen.append(t.device.type)
            return t

    monkeypatch.setattr(groupmod, "TorchGroup", Torch)
    g = groupmod._CpuOrTorch(Inner(), None)
    g.all_reduce(torch.ones(2, device="meta"))
    assert g._torch.seen == ["meta"]
    assert isinstance(groupmod.group_for_device(torch.device("cuda", 0)), Torch)
    assert isinstance(groupmod.group_for_device(torch.device("cpu"), "torch"), Torch)
