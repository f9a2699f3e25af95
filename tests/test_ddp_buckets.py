# tests/test_ddp_buckets.py: the bucketed DDP path's layout of gradient buckets over the flat buffer.
# Not for: numerics (test_parity.py compares N processes with one, test_split_step.py the split step).
import torch


def test_bucket_layout():
    """Buckets tile the flat gradient buffer in reverse registration order: a first bucket of at most 1 MiB,
    cap-sized ones, and a last one of at most 1 MiB when the remainder is larger (it is never overlapped)."""
    from accelerate_c.ddp.bucketed import FIRST_BUCKET_BYTES, BucketedGradSync

    class Local:
        def alloc(self, n, dtype, device):
            return torch.zeros(n, dtype=dtype)

    layers = [torch.nn.Linear(512, 512) for _ in range(12)]  # 12 x ~1 MiB
    params = [p for m in layers for p in m.parameters()]
    s = BucketedGradSync(params, Local(), 3.0)
    sizes = [b.numel * 4 for b in s.buckets]
    assert sum(b.numel for b in s.buckets) == sum(p.numel() for p in params)
    assert [b.offset for b in s.buckets] == [sum(b.numel for b in s.buckets[:i]) for i in range(len(s.buckets))]
    assert sizes[0] <= FIRST_BUCKET_BYTES and sizes[-1] <= FIRST_BUCKET_BYTES
    assert all(x <= 3 << 20 for x in sizes) and len(sizes) >= 5
    for i, p in enumerate(s.params):  # each param's view lies inside the bucket the counter assigns it
        v = s.views[i]
        start = (v.data_ptr() - s.buffers[torch.float32].data_ptr()) // 4
        b = next(k for k, bk in enumerate(s.buckets) if bk.offset <= start < bk.offset + bk.numel)
        assert start + v.numel() <= s.buckets[b].offset + s.buckets[b].numel
    s.remove()
