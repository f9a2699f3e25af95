# tests/test_data_loader.py: accelerate_c's sharding samplers and prepared loaders against HF Accelerate 1.15
# itself (exact per-rank index lists, lengths, end_of_dataloader, remainder, set_epoch, seedable sampler,
# skip_first_batches), single-process with explicit num_processes/process_index. The resume tests (beyond HF)
# check that state_dict/load_state_dict replays exactly the uninterrupted sequence.
import itertools
import json

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, SequentialSampler

import accelerate.data_loader as hf
import accelerate_c.data_loader as ours


@pytest.fixture(autouse=True, scope="module")
def _hf_state():
    # HF's synchronize_rng_states reads AcceleratorState, which refuses to exist without an Accelerator
    from accelerate.state import AcceleratorState

    from accelerate.utils import TorchDynamoPlugin

    AcceleratorState(cpu=True, _from_accelerator=True, dynamo_plugin=TorchDynamoPlugin())
    yield
    AcceleratorState._reset_state(True)


def _bs(n, bs, drop_last):
    return BatchSampler(SequentialSampler(range(n)), batch_size=bs, drop_last=drop_last)


def _shard_lists(mod, n, bs, N, split, even, drop_last):
    return [list(mod.BatchSamplerShard(_bs(n, bs, drop_last), num_processes=N, process_index=r, split_batches=split,
                                       even_batches=even)) for r in range(N)]


def test_batch_sampler_shard_matches_hf_exhaustively():
    checked = 0
    for n, bs, N, split, even, drop_last in itertools.product(range(0, 27), (1, 2, 3, 4, 6), (1, 2, 3, 4),
                                                              (False, True), (True, False), (False, True)):
        if split and bs % N != 0:
            with pytest.raises(ValueError):
                ours.BatchSamplerShard(_bs(n, bs, drop_last), num_processes=N, split_batches=True)
            continue
        expect = _shard_lists(hf, n, bs, N, split, even, drop_last)
        got = _shard_lists(ours, n, bs, N, split, even, drop_last)
        assert got == expect, (n, bs, N, split, even, drop_last)
        for r in range(N):
            h = hf.BatchSamplerShard(_bs(n, bs, drop_last), N, r, split, even)
            o = ours.BatchSamplerShard(_bs(n, bs, drop_last), N, r, split, even)
            assert len(o) == len(h) and o.total_length == h.total_length
        checked += 1
    assert checked > 1500


class _VarBatches:
    """A batch sampler without batch_size (variable-size batches)."""

    def __init__(self, batches):
        self.batches = batches

    def __iter__(self):
        return iter([list(b) for b in self.batches])

    def __len__(self):
        return len(self.batches)


@pytest.mark.parametrize("sizes", [[3, 1, 2], [2, 2, 2, 1, 5], [1], [4, 4, 4, 4], [2, 3, 1, 1, 1, 2, 2]])
@pytest.mark.parametrize("N", [2, 3])
@pytest.mark.parametrize("even", [True, False])
def test_batch_sampler_shard_variable_batches(sizes, N, even):
    batches, start = [], 0
    for s in sizes:
        batches.append(list(range(start, start + s)))
        start += s
    for r in range(N):
        h = list(hf.BatchSamplerShard(_VarBatches(batches), N, r, even_batches=even))
        o = list(ours.BatchSamplerShard(_VarBatches(batches), N, r, even_batches=even))
        assert o == h


class _Range(IterableDataset):
    def __init__(self, n):
        self.n = n

    def __iter__(self):
        return iter(range(self.n))

    def __len__(self):
        return self.n


def test_iterable_dataset_shard_matches_hf():
    for n, bs, N, split, drop_last in itertools.product(range(0, 23), (1, 2, 3, 4), (1, 2, 3), (False, True),
                                                        (False, True)):
        if split and bs > 1 and bs % N:
            continue
        for r in range(N):
            kw = dict(batch_size=bs, drop_last=drop_last, num_processes=N, process_index=r, split_batches=split)
            h, o = hf.IterableDatasetShard(_Range(n), **kw), ours.IterableDatasetShard(_Range(n), **kw)
            h.set_epoch(0), o.set_epoch(0)
            assert list(o) == list(h), (n, bs, N, split, drop_last, r)
            assert len(o) == len(h)


def _run_epochs(dl, epochs):
    """Batches (as lists) and (end_of_dataloader, remainder) seen at each batch, for several epochs."""
    out = []
    for _ in range(epochs):
        for b in dl:
            out.append((b.tolist() if isinstance(b, torch.Tensor) else b, dl.end_of_dataloader, dl.remainder))
    return out


PREPARE_CASES = [
    dict(n=23, bs=4, shuffle=False), dict(n=23, bs=4, shuffle=True), dict(n=24, bs=4, shuffle=True, split=True),
    dict(n=7, bs=2, shuffle=True, even=False), dict(n=10, bs=3, shuffle=True, drop_last=True),
    dict(n=19, bs=4, shuffle=True, seedable=True), dict(n=19, bs=4, shuffle=True, seedable=True, data_seed=7),
    dict(n=3, bs=1, shuffle=False, even=False), dict(n=11, bs=2, shuffle=True, generator=True),
]


# split_batches needs bs % N == 0, so those cases run only where it holds
@pytest.mark.parametrize("case,N", [(c, n) for c in PREPARE_CASES for n in (1, 2, 3)
                                    if not (c.get("split") and c["bs"] % n)])
def test_prepare_data_loader_matches_hf(case, N):
    for r in range(N):
        results = []
        for mod in (hf, ours):
            torch.manual_seed(1234)
            gen = torch.Generator().manual_seed(99) if case.get("generator") else None
            base = DataLoader(list(range(case["n"])), batch_size=case["bs"], shuffle=case["shuffle"],
                              drop_last=case.get("drop_last", False), generator=gen)
            dl = mod.prepare_data_loader(base, num_processes=N, process_index=r, split_batches=case.get("split", False),
                                         even_batches=case.get("even", True), rng_types=["generator"],
                                         use_seedable_sampler=case.get("seedable", False),
                                         data_seed=case.get("data_seed"))
            results.append((_run_epochs(dl, 3), len(dl), dl.total_batch_size, dl.total_dataset_length, dl.iteration))
        assert results[1] == results[0], (case, N, r)


def test_set_epoch_and_seedable_sampler_orders_match_hf():
    for mod_pair in [(hf, ours)]:
        orders = []
        for mod in mod_pair:
            torch.manual_seed(5)
            dl = mod.prepare_data_loader(DataLoader(list(range(16)), batch_size=4, shuffle=True), num_processes=2,
                                         process_index=1, use_seedable_sampler=True, data_seed=3)
            seq = []
            for epoch in (4, 1, 4):
                dl.set_epoch(epoch)
                seq.append([b.tolist() for b in dl])
            orders.append((seq, dl.iteration))
        assert orders[1] == orders[0]
        assert orders[0][0][0] == orders[0][0][2] and orders[0][0][0] != orders[0][0][1]


def test_iterable_prepare_and_dispatch_single_process_match_hf():
    for N, r, split in [(2, 0, False), (2, 1, False), (3, 2, True)]:
        got = [_run_epochs(m.prepare_data_loader(DataLoader(_Range(17), batch_size=3 if not split else 3),
                                                 num_processes=N, process_index=r, split_batches=split), 2)
               for m in (hf, ours)]
        assert got[1] == got[0]
    # dispatch mode on one process (put_on_device → dispatch for IterableDataset)
    got = [_run_epochs(m.prepare_data_loader(DataLoader(_Range(17), batch_size=3), device=torch.device("cpu"),
                                             put_on_device=True), 2) for m in (hf, ours)]
    assert got[1] == got[0]


# iterable datasets have no sampler, so no shuffled iterable case
@pytest.mark.parametrize("shuffle,iterable", [(False, False), (True, False), (False, True)])
def test_skip_first_batches_matches_hf_and_keeps_settings(shuffle, iterable):
    outs = []
    for mod in (hf, ours):
        torch.manual_seed(0)
        data = _Range(21) if iterable else list(range(21))
        dl = mod.prepare_data_loader(DataLoader(data, batch_size=2, shuffle=shuffle, drop_last=True),
                                     num_processes=2, process_index=1, non_blocking=True)
        skipped = mod.skip_first_batches(dl, 2)
        outs.append(([b[:2] for b in _run_epochs(skipped, 1)], len(skipped)))
    assert outs[1] == outs[0]
    assert skipped.remainder == -1  # drop_last kept: no remainder (HF 1.15 reports one after skipping)
    assert skipped._drop_last is True and skipped._non_blocking is True  # HF 1.15 loses these (#4295)
    plain = ours.skip_first_batches(DataLoader(list(range(10)), batch_size=3), 2)
    assert [b.tolist() for b in plain] == [[6, 7, 8], [9]]


def test_gradient_state_end_of_dataloader_and_remainder():
    from accelerate_c.state import GradientState

    gs = GradientState()
    dl = ours.prepare_data_loader(DataLoader(list(range(10)), batch_size=4), num_processes=1, process_index=0)
    seen = []
    for _ in dl:
        seen.append((gs.in_dataloader, gs.end_of_dataloader, gs.remainder))
    assert seen == [(True, False, 2), (True, False, 2), (True, True, 2)]
    assert not gs.in_dataloader


# ---- resume (beyond HF) -------------------------------------------------------------------------------------
def _make(kind, seed):
    """A fresh 'process': global RNG seeded, loader prepared as the Accelerator would."""
    torch.manual_seed(seed)
    if kind == "iterable":
        return ours.prepare_data_loader(DataLoader(_Range(13), batch_size=2), num_processes=2, process_index=1,
                                        rng_types=["generator"])
    if kind.startswith("dispatch"):
        data = _Range(13) if kind == "dispatch_iterable" else list(range(13))
        return ours.prepare_data_loader(DataLoader(data, batch_size=2, shuffle=kind == "dispatch_shuffle"),
                                        device=torch.device("cpu"), put_on_device=True, dispatch_batches=True)
    n, N, r = 13, 1, 0
    kw = {}
    if kind == "shuffle_global":  # sampler without generator: the order comes from the global RNG
        kw = dict(shuffle=True)
    elif kind == "shuffle_generator":
        kw = dict(shuffle=True, generator=torch.Generator().manual_seed(seed + 1))
    elif kind in ("shuffle_sharded", "seedable", "workers"):
        kw, N, r = dict(shuffle=True), 2, 1
        if kind == "workers":
            kw["num_workers"] = 2
    base = DataLoader(list(range(n)), batch_size=2, **kw)
    return ours.prepare_data_loader(base, num_processes=N, process_index=r, rng_types=["generator"],
                                    use_seedable_sampler=(kind == "seedable"))


def _train(dl, epochs, stop_after=None, log=None):
    """Iterate `epochs` epochs; after each batch draw one number from the global RNG (a stand-in for dropout).
    Returns the log and, when stop_after is reached, (state_dict, global rng state) at that point."""
    log = [] if log is None else log
    steps = 0
    for _ in range(epochs):
        for b in dl:
            log.append((b.tolist(), torch.rand(1).item()))
            steps += 1
            if steps == stop_after:
                return log, (dl.state_dict(), torch.get_rng_state())
    return log, None


def _jsonable(sd):
    def walk(v):
        if isinstance(v, torch.Tensor):
            return None
        if isinstance(v, dict):
            return {k: walk(x) for k, x in v.items()}
        return v

    json.dumps(walk(sd))  # raises on anything that is not JSON-able or a tensor


@pytest.mark.parametrize("kind", ["plain", "shuffle_global", "shuffle_generator", "shuffle_sharded", "seedable",
                                  "iterable", "workers", "dispatch_shuffle", "dispatch_iterable"])
def test_state_dict_resume_equals_uninterrupted(kind):
    epochs = 3
    full, _ = _train(_make(kind, 11), epochs)
    per_epoch = len(full) // epochs
    cuts = [1, per_epoch - 1, per_epoch, per_epoch + 2, 2 * per_epoch] if kind != "workers" else [per_epoch + 2]
    for cut in cuts:
        dl = _make(kind, 11)
        head, (sd, rng) = _train(dl, epochs, stop_after=cut)
        _jsonable(sd)
        sd = torch.utils._pytree.tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, sd)
        fresh = _make(kind, 999)  # a new process with different seeds
        fresh.load_state_dict(sd)
        torch.set_rng_state(rng)  # what Accelerator.load_state restores
        done = sd["iteration"]
        tail, _ = _train(fresh, epochs - done)
        assert head + tail == full, (kind, cut)


@pytest.mark.parametrize("kind", ["shuffle_global", "shuffle_sharded", "seedable"])
def test_resume_via_skip_first_batches_equals_uninterrupted(kind):
    epochs = 3
    full, _ = _train(_make(kind, 5), epochs)
    per_epoch = len(full) // epochs
    cut = per_epoch + 2
    head, (sd, rng) = _train(_make(kind, 5), epochs, stop_after=cut)
    fresh = _make(kind, 77)
    fresh.load_state_dict(sd, resume_position=False)
    torch.set_rng_state(rng)
    skipped = ours.skip_first_batches(fresh, sd["batches_yielded"])
    tail, _ = _train(skipped, 1)
    assert fresh.iteration == sd["iteration"] + 1  # the skip loader reported the finished epoch
    tail, _ = _train(fresh, epochs - fresh.iteration, log=tail)
    assert head + tail == full


def test_parent_state_dict_follows_skip_loader_and_pickling():
    import pickle

    dl = _make("shuffle_sharded", 3)
    skipped = ours.skip_first_batches(dl, 2)
    it = iter(skipped)
    next(it)
    sd = dl.state_dict()  # the parent reports the position of the child being iterated
    assert sd["mid_epoch"] and sd["batches_yielded"] == 3 and sd["iteration"] == 0
    rest = [b.tolist() for b in it]
    assert dl.iteration == 1 and not dl.state_dict()["mid_epoch"]
    clone = pickle.loads(pickle.dumps(dl))
    assert clone.iteration == 1 and len([b for b in clone]) == len(dl)
    assert len(rest) == len(dl) - 3


@pytest.mark.parametrize("kind", ["shuffle_global", "shuffle_sharded", "dispatch_shuffle"])
def test_state_dict_between_epochs(kind):
    full, _ = _train(_make(kind, 21), 3)
    dl = _make(kind, 21)
    head, _ = _train(dl, 1)
    sd, rng = dl.state_dict(), torch.get_rng_state()
    assert sd["mid_epoch"] is False and sd["iteration"] == 1
    fresh = _make(kind, 4)
    fresh.load_state_dict(sd)
    torch.set_rng_state(rng)
    tail, _ = _train(fresh, 2)
    assert head + tail == full
