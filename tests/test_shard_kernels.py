# tests/test_shard_kernels.py: the sharded engine's C copy-in (_C.pack, csrc/ops/pack.c, and its Python face
# accelerate_c/sharding/pack.py) against torch's own copies, bit for bit: every fp32/bf16/fp16 source/destination
# pair, odd sizes and offsets, gaps and a zeroed padding tail, empty pieces and an empty destination, 1-3 threads
# on a destination big enough to be split, every SIMD level this CPU runs; and the errors bad input gets.
# The reference is `dst.zero_(); dst[off:off+n].copy_(src)` (torch's .to(): round-to-nearest-even). Inputs hold
# no NaN here (torch's NaN pattern depends on its vector loop vs scalar tail); a NaN only has to stay a NaN.
# Not for: the engine (tests/test_sharded_shardc.py) or the fused step's compute copy (tests/test_optim.py).
import pytest
import torch
from simd_levels import LEVELS, simd

from accelerate_c import _C
from accelerate_c.sharding.pack import pack

DT = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(params=LEVELS)
def level(request):
    with simd(request.param):
        yield request.param


def values(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random values spanning the fp16 range and beyond (overflow to inf), with ties, -0, subnormals, infs."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.pow(2.0, torch.randint(-30, 18, (n,), generator=g).float())
    specials = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), 65520.0, 65519.0, 1 + 2 ** -8, 1 + 3 * 2 ** -8,
                             2 ** -24, 2 ** -25, 3 * 2 ** -26, 1e-40, -1e-45, 3.0e38])
    k = min(n, specials.numel())
    x[:k] = specials[:k]
    return x.to(dtype)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({4: torch.int32, 2: torch.int16}[t.element_size()])


def reference(dst_dtype, size, offsets, srcs):
    out = torch.zeros(size, dtype=dst_dtype)
    for off, s in zip(offsets, srcs):
        if s is not None:
            out[off:off + s.numel()].copy_(s)
    return out


def layout(sizes, gaps, seed, dtypes):
    offsets, srcs, off = [], [], 0
    for i, (n, gap) in enumerate(zip(sizes, gaps)):
        off += gap
        offsets.append(off)
        srcs.append(None if n is None else values(n, dtypes[i % len(dtypes)], seed + i))
        off += 0 if n is None else n
    return offsets, srcs, off


@pytest.mark.parametrize("dst_dtype", DT)
@pytest.mark.parametrize("src_dtype", DT)
def test_pack_matches_torch_copies(level, src_dtype, dst_dtype):
    # odd sizes, a gap, an empty piece, a None piece (zeros), a padding tail; unaligned offsets
    sizes, gaps = [1, 17, 0, 31, None, 1000, 3], [0, 3, 0, 5, 2, 1, 0]
    offsets, srcs, end = layout(sizes, gaps, 7, [src_dtype])
    for tail in (0, 1, 13):
        dst = torch.full((end + tail,), 7.0, dtype=dst_dtype)
        _C.pack(dst, srcs, offsets, 1)
        ref = reference(dst_dtype, end + tail, offsets, srcs)
        assert torch.equal(bits(dst), bits(ref)), (src_dtype, dst_dtype, tail)


def test_pack_mixed_source_dtypes(level):
    offsets, srcs, end = layout([100, 33, 64, 5], [0, 0, 7, 0], 3, DT)
    for dst_dtype in DT:
        dst = torch.empty(end + 9, dtype=dst_dtype)
        _C.pack(dst, srcs, offsets, 2)
        assert torch.equal(bits(dst), bits(reference(dst_dtype, end + 9, offsets, srcs))), dst_dtype


@pytest.mark.parametrize("dst_dtype", DT)
def test_pack_threads_split_a_big_destination(level, dst_dtype):
    """> 6M elements (the kernel gives each thread >= 2M): 2 and 3 threads split mid-piece and mid-gap; every
    count gives torch's bits."""
    sizes, gaps = [1_900_001, 7, 2_500_000, 1_250_003, None, 700_000], [0, 11, 1, 0, 2_000, 4]
    offsets, srcs, end = layout(sizes, gaps, 11, [torch.float32, torch.bfloat16])
    ref = reference(dst_dtype, end + 21, offsets, srcs)
    for nthreads in (1, 2, 3):
        dst = torch.full((end + 21,), 5.0, dtype=dst_dtype)
        _C.pack(dst, srcs, offsets, nthreads)
        assert torch.equal(bits(dst), bits(ref)), nthreads


def test_pack_empty():
    dst = torch.empty(0)
    _C.pack(dst, [], [], 1)
    _C.pack(dst, [torch.empty(0)], [0], 1)
    dst = torch.full((5,), 3.0, dtype=torch.bfloat16)
    _C.pack(dst, [], [], 1)  # nothing to copy: all zeros
    assert torch.equal(bits(dst), torch.zeros(5, dtype=torch.int16))


def test_pack_nan_stays_nan():
    src = torch.tensor([float("nan"), 1.0, -float("nan"), 2.0] * 20)
    for dst_dtype in DT:
        dst = torch.empty(80, dtype=dst_dtype)
        _C.pack(dst, [src], [0], 1)
        assert torch.isnan(dst.float()).tolist() == torch.isnan(src).tolist()


def test_pack_python_face_and_torch_fallback(monkeypatch):
    offsets, srcs, end = layout([40, None, 9], [1, 3, 2], 5, [torch.float32])
    srcs[0] = srcs[0].view(8, 5).t()  # non-contiguous: the torch copies take it
    ref = torch.zeros(end + 3, dtype=torch.bfloat16)
    ref[offsets[0]:offsets[0] + 40] = srcs[0].reshape(-1).bfloat16()
    ref[offsets[2]:offsets[2] + 9] = srcs[2].bfloat16()
    for flag in ("1", "0"):
        monkeypatch.setenv("ACCELERATE_C_SHARD_KERNELS", flag)
        out = torch.full((end + 3,), 2.0, dtype=torch.bfloat16)
        pack(out, offsets, srcs)
        assert torch.equal(bits(out), bits(ref)), flag
        srcs2 = [srcs[0].contiguous(), None, srcs[2]]
        out.fill_(2.0)
        pack(out, offsets, srcs2)
        assert torch.equal(bits(out), bits(ref)), flag


@pytest.mark.parametrize("srcs,offsets,dst,match,exc", [
    ([torch.ones(4)], [0], torch.empty(3), "outside the destination", ValueError),
    ([torch.ones(4), torch.ones(2)], [0, 3], torch.empty(8), "increasing offset order", ValueError),
    ([torch.ones(2), torch.ones(2)], [4, 0], torch.empty(8), "increasing offset order", ValueError),
    ([torch.ones(2)], [-1], torch.empty(8), "negative", ValueError),
    ([torch.ones(2)], [0, 1], torch.empty(8), "1 sources but 2 offsets", ValueError),
    ([torch.ones(2, dtype=torch.float64)], [0], torch.empty(8), "float64", TypeError),
    ([torch.ones(2)], [0], torch.empty(8, dtype=torch.int32), "int32", TypeError),
    ([torch.ones(4).t()[None].expand(2, 4)], [0], torch.empty(8), "contiguous", ValueError),
])
def test_pack_bad_input(srcs, offsets, dst, match, exc):
    with pytest.raises(exc, match=match):
        _C.pack(dst, srcs, offsets, 1)


def test_pack_refuses_overlap_with_destination():
    buf = torch.zeros(16)
    with pytest.raises(ValueError, match="overlaps the destination"):
        _C.pack(buf[:8], [buf[4:12]], [0], 1)
