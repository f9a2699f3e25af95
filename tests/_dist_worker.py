# tests/_dist_worker.py: one rank of the 2-process gloo runs of tests/test_operations.py. Runs every check
# (our collectives vs known values and vs HF Accelerate 1.15's, prepare_data_loader vs HF's in a real
# 2-process setting, distributed resume) and writes {check: "ok" | error text} to <outdir>/rank<r>.json.
# Not for: running under pytest directly (it is spawned by tests/test_operations.py).
import json
import os
import sys
import traceback

import torch
from torch.utils.data import DataLoader, IterableDataset

RESULTS = {}


def check(name):
    def deco(fn):
        try:
            fn()
            RESULTS[name] = "ok"
        except Exception:
            RESULTS[name] = traceback.format_exc()
        return fn
    return deco


def same(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


class Range(IterableDataset):
    def __init__(self, n):
        self.n = n

    def __iter__(self):
        return iter(torch.arange(self.n).float()[:, None].unbind(0))

    def __len__(self):
        return self.n


def main(outdir):
    rank = int(os.environ["RANK"])
    from accelerate_c.state import AcceleratorState as OurAccState
    from accelerate_c.state import PartialState
    from accelerate_c.utils import operations as ops
    from accelerate_c.utils import random as orandom
    import accelerate_c.data_loader as odl

    st = PartialState(cpu=True)
    OurAccState(cpu=True)
    assert st.num_processes == 2 and st.distributed_type == "MULTI_CPU"
    from accelerate.state import AcceleratorState
    from accelerate.utils import TorchDynamoPlugin
    import accelerate.utils.operations as hops
    import accelerate.data_loader as hdl

    AcceleratorState(cpu=True, _from_accelerator=True, dynamo_plugin=TorchDynamoPlugin())

    @check("gather")
    def _():
        t = torch.tensor([2.0 * rank + 1, 2.0 * rank + 2])
        assert same(ops.gather(t), torch.tensor([1.0, 2, 3, 4]))
        nc = (torch.arange(6).view(2, 3) + 10 * rank).t()  # non-contiguous
        assert not nc.is_contiguous()
        assert same(ops.gather(nc), hops.gather(nc))
        nested = {"a": torch.tensor(rank), "b": [torch.ones(2, 2) * rank, (torch.tensor([rank]),)]}
        got = ops.gather(nested)
        assert same(got, hops.gather(nested)) and got["a"].tolist() == [0, 1]
        try:
            ops.gather({"x": "not a tensor"})
            raise AssertionError("no TypeError")
        except TypeError:
            pass

    @check("gather_object")
    def _():
        assert ops.gather_object([rank]) == [0, 1]
        assert ops.gather_object([{"r": rank}, "x"]) == hops.gather_object([{"r": rank}, "x"])

    @check("broadcast")
    def _():
        assert same(ops.broadcast(torch.full((3,), float(rank)), from_process=1), torch.full((3,), 1.0))
        data = {"x": torch.arange(4) * (rank + 1), "y": [torch.tensor([rank])]}
        ref = hops.broadcast({"x": torch.arange(4) * (rank + 1), "y": [torch.tensor([rank])]})
        assert same(ops.broadcast(data), ref) and data["x"].tolist() == [0, 1, 2, 3]
        objs = [rank, {"k": rank}] if rank == 0 else [None, None]
        assert ops.broadcast_object_list(objs) == [0, {"k": 0}]

    @check("reduce")
    def _():
        t = torch.tensor([float(rank + 1), float(2 * rank)])
        assert same(ops.reduce(t, "sum"), torch.tensor([3.0, 2.0]))
        assert same(ops.reduce(t), torch.tensor([1.5, 1.0]))  # default is mean
        assert same(ops.reduce(t, "max"), torch.tensor([2.0, 2.0]))
        assert same(t, torch.tensor([float(rank + 1), float(2 * rank)]))  # input untouched
        for red in ("sum", "mean", "max"):
            nested = [t, {"z": t * 2}]
            assert same(ops.reduce(nested, red), hops.reduce(nested, red))

    def outcome(fn):
        """fn()'s result, or the type of the exception it raised (compared between ours and HF's)."""
        try:
            return fn()
        except Exception as e:
            return type(e)

    @check("reduce_vs_hf")
    def _():
        # every dtype HF's reduce takes, sizes around the transport's 64 KiB small buffer and 1 MiB chunk
        # (4-byte elements), and a multi-chunk one that also comes from the output-block cache
        gen = torch.Generator().manual_seed(77 + rank)
        sizes = [1, 16383, 16384, 16385, 262143, 262145, (3 << 18) + 5]
        for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int32, torch.int64,
                      torch.int8, torch.uint8):
            for n in sizes if dtype in (torch.float32, torch.bfloat16, torch.int64) else sizes[:4]:
                x = (torch.randn(n, generator=gen) * 20).to(dtype)
                keep = x.clone()
                for red in ("sum", "mean", "max"):
                    got, ref = outcome(lambda: ops.reduce(x, red)), outcome(lambda: hops.reduce(x, red))
                    assert same(got, ref), (dtype, n, red, got if isinstance(got, type) else "tensor")
                    assert same(x, keep), ("input changed", dtype, n, red)
        # 0-d, non-contiguous (transposed: strides kept as HF's clone keeps them; strided slice), grad
        m = torch.randn(64, 48, generator=gen)
        for t in (torch.tensor(rank + 0.25), torch.tensor(rank, dtype=torch.int64), m.t(), m[:, ::3]):
            for red in ("sum", "mean", "max"):
                got, ref = outcome(lambda: ops.reduce(t, red)), outcome(lambda: hops.reduce(t, red))
                assert same(got, ref), (t.shape, t.dtype, red)
                if isinstance(got, torch.Tensor):
                    assert got.stride() == ref.stride(), (t.shape, red, got.stride(), ref.stride())
        w = torch.randn(5, 3, generator=gen, requires_grad=True)
        for red in ("sum", "mean"):
            got, ref = ops.reduce(w * 2, red), hops.reduce(w * 2, red)
            assert torch.equal(got, ref) and got.requires_grad == ref.requires_grad == True, red
        nested = {"a": torch.tensor(rank), "b": [torch.ones(3, 2) * rank, (torch.tensor([rank + 0.5]),)]}
        for red in ("sum", "mean", "max"):
            assert same(outcome(lambda: ops.reduce(nested, red)), outcome(lambda: hops.reduce(nested, red))), red

    @check("gather_vs_hf")
    def _():
        gen = torch.Generator().manual_seed(99 + rank)
        m = torch.randn(300, 40, generator=gen)
        for t in (torch.randn(1024, generator=gen), torch.randn(4, 128, 129, generator=gen).to(torch.bfloat16),
                  torch.randn(1 << 19, generator=gen), torch.tensor(rank + 0.5), m.t(), m[::2],
                  torch.arange(7, dtype=torch.int64) * rank, torch.ones(0, 3)):
            keep = t.clone()
            got, ref = ops.gather(t), hops.gather(t)
            assert same(got, ref) and got.is_contiguous(), (t.shape, t.dtype)
            assert same(t, keep), ("input changed", t.shape)

    @check("output_cache_reuse")
    def _():
        from accelerate_c.comm import outbuf
        x = torch.full((1 << 19,), float(rank + 1))  # 2 MiB: results come from the cache
        r1 = ops.reduce(x, "sum")
        p1 = r1.data_ptr()
        del r1
        r2 = ops.reduce(x, "max")  # r1 was dropped: its block serves again
        assert r2.data_ptr() == p1 and bool((r2 == 2.0).all())
        view = r2[10:20]
        del r2
        r3 = ops.reduce(x, "sum")  # r2's block is still held by a view of it: not reused
        assert r3.data_ptr() != p1 and bool((r3 == 3.0).all()) and bool((view == 2.0).all())
        assert outbuf.held_bytes() <= outbuf.limit_bytes()

    @check("pad_across_processes")
    def _():
        t = torch.arange(2 * (rank + 1)).view(rank + 1, 2) + 1
        for kw in ({}, {"pad_index": -1}, {"pad_first": True, "pad_index": 7}, {"dim": 1}, {"dim": -2}):
            got, ref = ops.pad_across_processes(t, **kw), hops.pad_across_processes(t, **kw)
            assert same(got, ref), kw
        assert ops.pad_across_processes(t).shape == (2, 2)
        nested = {"a": t, "b": [torch.ones(rank + 2)]}
        assert same(ops.pad_across_processes(nested), hops.pad_across_processes(nested))

    @check("debug_mode")
    def _():
        st.debug = True
        try:
            bad = torch.ones(1, 5) if rank == 0 else torch.ones(1, 1, 6)
            for fn in (lambda: ops.pad_across_processes({"tensor": bad}, dim=0), lambda: ops.reduce(bad),
                       lambda: ops.broadcast(bad)):
                try:
                    fn()
                    raise AssertionError("no DistributedOperationException")
                except ops.DistributedOperationException:
                    pass
            assert same(ops.reduce(torch.ones(2), "sum"), torch.full((2,), 2.0))  # matching shapes still work
        finally:
            st.debug = False

    @check("copy_tensor_to_devices")
    def _():
        got = ops.copy_tensor_to_devices(torch.arange(3.0) + 1 if rank == 0 else None)
        assert same(got, torch.tensor([1.0, 2.0, 3.0]))

    @check("rng_sync")
    def _():
        torch.manual_seed(100 + rank)
        g = torch.Generator().manual_seed(200 + rank)
        orandom.synchronize_rng_states(["torch", "generator"], generator=g)
        vals = ops.gather(torch.stack([torch.rand(()), torch.rand((), generator=g)])[None])
        assert same(vals[0], vals[1])
        orandom.set_seed(3, device_specific=True)
        v = ops.gather(torch.rand(1))
        assert v[0] != v[1]
        orandom.set_seed(3)
        v = ops.gather(torch.rand(1))
        assert v[0] == v[1]

    def run(mod, dataset, epochs=2, **kw):
        torch.manual_seed(4321 + rank)  # ranks differ: the loaders must synchronise the shuffle
        base = DataLoader(dataset, batch_size=kw.pop("batch_size"), shuffle=kw.pop("shuffle", False),
                          drop_last=kw.pop("drop_last", False))
        dl = mod.prepare_data_loader(base, device=torch.device("cpu"), put_on_device=True, rng_types=["generator"],
                                     **kw)
        out = []
        for _ in range(epochs):
            for b in dl:
                out.append((b.tolist(), dl.end_of_dataloader, dl.remainder))
        return out, len(dl)

    cases = [
        dict(n=23, batch_size=4, shuffle=True), dict(n=23, batch_size=4, shuffle=True, even_batches=False),
        dict(n=22, batch_size=4, split_batches=True, shuffle=True), dict(n=9, batch_size=2, drop_last=True),
        dict(n=3, batch_size=1, even_batches=False), dict(n=19, batch_size=3, use_seedable_sampler=True, shuffle=True),
        dict(n=23, batch_size=4, dispatch_batches=True), dict(n=22, batch_size=4, dispatch_batches=True,
                                                               split_batches=True),
        dict(n=23, batch_size=3, iterable=True), dict(n=23, batch_size=4, iterable=True, split_batches=True),
        dict(n=23, batch_size=3, iterable=True, dispatch_batches=False),
    ]
    for i, case in enumerate(cases):
        @check(f"prepare_vs_hf_{i}")
        def _():
            c = dict(case)
            n = c.pop("n")
            data = Range(n) if c.pop("iterable", False) else [torch.tensor([float(j)]) for j in range(n)]
            ours_out, hf_out = run(odl, data, **dict(c)), run(hdl, data, **dict(c))
            assert ours_out == hf_out, (case, ours_out, hf_out)

    @check("even_batches_sizes")
    def _():
        for even, expect in ((True, [1, 1]), (False, [1, 1] if rank == 0 else [1])):
            dl = odl.prepare_data_loader(DataLoader(list(range(3)), batch_size=1), even_batches=even)
            assert [len(b) for b in dl] == expect, (even, [b.tolist() for b in dl])

    for mode in ("shard", "dispatch", "dispatch_split"):
        @check(f"distributed_resume_{mode}")
        def _():
            def make(seed):
                torch.manual_seed(seed + rank)
                kw = dict(rng_types=["generator"])
                if mode != "shard":
                    kw.update(device=torch.device("cpu"), put_on_device=True, dispatch_batches=True,
                              split_batches=mode == "dispatch_split")
                return odl.prepare_data_loader(DataLoader(list(range(21)), batch_size=2, shuffle=True), **kw)

            ref = make(8)
            full = [b.tolist() for _ in range(3) for b in ref]
            dl, head, sd = make(8), [], None
            for _ in range(3):
                for b in dl:
                    head.append(b.tolist())
                    if len(head) == 7:
                        sd, rng = dl.state_dict(), torch.get_rng_state()
                        break
                if sd is not None:
                    break
            fresh = make(50)
            fresh.load_state_dict(sd)
            torch.set_rng_state(rng)  # as Accelerator.load_state does
            tail = [b.tolist() for _ in range(3 - sd["iteration"]) for b in fresh]
            assert head + tail == full, (head, tail, full)

    with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
        json.dump(RESULTS, f)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
    # Leave without the interpreter's teardown, which can race torch's gloo worker threads and abort a
    # finished process (see accelerate_c/commands/_bootstrap.py, which does the same for launched ranks).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
