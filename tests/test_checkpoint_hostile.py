# tests/test_checkpoint_hostile.py: checkpoints from a broken or hostile source. A real 2-rank checkpoint (the
# fake flat-shard layout of test_checkpoint_universal, saved by two threads: pieces spread over two files per model
# and optimizer) is mutated by a seeded fuzzer: JSON values deleted, retyped, renamed to paths outside the
# checkpoint, nested 200k deep; safetensors headers with negative, overlapping, aliased or out-of-file offsets,
# shapes of 10^12 or 2^62 x 8 elements, unknown dtypes, wrong header lengths; files truncated, extended, replaced
# by symbolic links, FIFOs and directories. Every mutation must give either exactly the original tensors or a
# CheckpointError, and a failed load must leave the model, optimizer, scheduler, RNG, data position, custom object
# and step exactly as they were. Also the explicit cases of the issue, one by one, and merge-weights on them.
# Not for: the 2-process agreement (test_checkpoint_agree.py) or kills during a save (test_checkpointing.py).
import copy
import json
import os
import random
import shutil
import signal
import struct
import threading

import numpy as np
import pytest
import torch

from accelerate_c.checkpointing import CheckpointError, load_state, save_state
from bitwise import same
from test_checkpoint_universal import sharded
from test_checkpointing import FakeAccelerator
from conftest import rewrite_listed


# ----------------------------------------------------------------------------------------------- fixtures
def _save_two_ranks(path):
    """A 2-rank flat-shard checkpoint written by two threads (each rank its own pieces, barriers between)."""
    barrier = threading.Barrier(2, timeout=60)
    accs = [sharded(FakeAccelerator(seed=0, rank=r, world=2, barrier=barrier.wait), r, 2) for r in range(2)]
    for acc in accs:                      # optimizer state for each rank's ranges (the model: the same on both)
        for step in range(2):
            for p in acc.opt.param_groups[0]["params"]:
                p.grad = torch.randn_like(p)
            acc.opt.step()
            acc.sched.step()
    errors = []

    def run(acc):
        try:
            save_state(acc, path)
        except BaseException as e:        # shown below; the other thread's barrier breaks instead of hanging
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=run, args=(a,)) for a in accs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and not any(t.is_alive() for t in threads), errors


def _fresh(kind):
    acc = FakeAccelerator(seed=5)
    return sharded(acc, 0, 2) if kind == "rank0of2" else acc


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("hostile") / "ck")
    _save_two_ranks(path)
    want = {}
    for kind in ("whole", "rank0of2"):
        acc = _fresh(kind)
        load_state(acc, path)
        want[kind] = _tensors(acc)
        assert want[kind]["opt"], "the checkpoint must hold optimizer state for the fuzzer to reach it"
    return path, want


def _tensors(acc):
    """What a load must restore exactly: the model's tensors and the optimizer's state tensors."""
    opt = acc.opt.state_dict()
    return {"model": {k: v.clone() for k, v in acc.model.state_dict().items()},
            "opt": {k: {n: v.clone() for n, v in st.items() if isinstance(v, torch.Tensor)}
                    for k, st in opt["state"].items()}}


def _everything(acc):
    """The whole state a failed load must leave untouched."""
    return {**_tensors(acc), "groups": copy.deepcopy(acc.opt.state_dict()["param_groups"]),
            "sched": copy.deepcopy(acc.sched.state_dict()), "torch_rng": torch.get_rng_state(),
            "py_rng": random.getstate(), "np_rng": np.random.get_state(), "step": acc.step,
            "counter": copy.deepcopy(acc.counter.state_dict()), "loader": acc.loader.state_dict()}


# ----------------------------------------------------------------------------------------------- mutations
def _paths(doc, at=()):
    yield at
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from _paths(v, at + (k,))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from _paths(v, at + (i,))


def _deep(n):
    return json.loads("[" * n + "]" * n) if n < 500 else None   # (built as text below when deeper)


BAD_VALUES = [None, -1, 2 ** 70, "x", "../outside/m", "/abs/path/x", ".hidden", [], {}, [-200, -72], True, 1.5,
              [10 ** 12], [2 ** 62, 8], "float128", "DEEP"]


def _mutate_json(d, name, rng):
    path = os.path.join(d, name)
    doc = json.load(open(path))
    where = rng.choice([p for p in _paths(doc) if p])
    parent = doc
    for k in where[:-1]:
        parent = parent[k]
    value = rng.choice(BAD_VALUES + ["DELETE"])
    text = None
    if value == "DELETE" and isinstance(parent, dict):
        del parent[where[-1]]
    elif value == "DEEP":
        parent[where[-1]] = "@@DEEP@@"
        text = json.dumps(doc).replace('"@@DEEP@@"', "[" * 200_000 + "]" * 200_000)
    else:
        parent[where[-1]] = value if value != "DELETE" else None
    open(path, "w").write(text if text is not None else json.dumps(doc))
    if rng.random() < 0.9 and name != "checkpoint.json":
        rewrite_listed(d, name)
    return f"{name}{list(where)} = {str(value)[:40]}"


def _read_st(path):
    raw = open(path, "rb").read()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def _write_st(path, header, data):
    hb = json.dumps(header).encode()
    open(path, "wb").write(struct.pack("<Q", len(hb)) + hb + data)


def _mutate_st(d, name, rng):
    path = os.path.join(d, name)
    header, data = _read_st(path)
    keys = [k for k in header if k != "__metadata__"] or ["__added__"]
    header.setdefault("__added__", {"dtype": "F32", "shape": [0], "data_offsets": [len(data), len(data)]})
    key = rng.choice(keys)
    e = header[key]
    lo, hi = e["data_offsets"]
    other = header[rng.choice(keys)]["data_offsets"]
    how = rng.choice(["negative", "other", "shift", "beyond", "swap", "huge_shape", "2^62", "neg_shape", "dtype",
                      "unknown_dtype", "shape_str", "offsets_str", "drop_key", "hdr_len", "truncate", "append",
                      "meta_type"])
    if how == "negative":
        e["data_offsets"] = [-200, -72]
    elif how == "other":
        e["data_offsets"] = list(other)
    elif how == "shift":
        e["data_offsets"] = [lo + 4, hi + 4]
    elif how == "beyond":
        e["data_offsets"] = [lo, len(data) + 64]
    elif how == "swap":
        e["data_offsets"] = [hi, lo]
    elif how == "huge_shape":
        e["shape"] = [10 ** 12]
    elif how == "2^62":
        e["shape"] = [2 ** 62, 8]
    elif how == "neg_shape":
        e["shape"] = [-1] + e["shape"][1:]
    elif how == "dtype":
        e["dtype"] = {"F32": "I32", "I32": "F32"}.get(e["dtype"], "U8")
    elif how == "unknown_dtype":
        e["dtype"] = "Q7"
    elif how == "shape_str":
        e["shape"] = "abc"
    elif how == "offsets_str":
        e["data_offsets"] = "abc"
    elif how == "drop_key":
        del e["dtype"]
    elif how == "meta_type":
        header["__metadata__"] = {"accelerate_c": 5}
    if how == "hdr_len":
        raw = open(path, "rb").read()
        open(path, "wb").write(struct.pack("<Q", rng.choice([0, 7, len(raw), 2 ** 63])) + raw[8:])
    elif how == "truncate":
        raw = open(path, "rb").read()
        open(path, "wb").write(raw[: rng.randrange(len(raw))])
    elif how == "append":
        open(path, "ab").write(b"\0" * 16)
    else:
        _write_st(path, header, data)
    if rng.random() < 0.9:
        rewrite_listed(d, name)
    return f"{name}: {key} {how}"


def _mutate_file(d, name, rng, outside):
    path = os.path.join(d, name)
    how = rng.choice(["symlink", "fifo", "dir", "remove"])
    shutil.copy(path, outside)
    os.remove(path)
    if how == "symlink":
        os.symlink(outside, path)
    elif how == "fifo":
        os.mkfifo(path)
    elif how == "dir":
        os.mkdir(path)
    return f"{name}: {how}"


def _mutation(d, rng, outside):
    names = sorted(os.listdir(d))
    family = rng.choice(["json", "json", "st", "st", "file"])
    if family == "json":
        return _mutate_json(d, rng.choice([n for n in names if n.endswith(".json")]), rng)
    if family == "st":
        return _mutate_st(d, rng.choice([n for n in names if n.endswith(".safetensors")]), rng)
    return _mutate_file(d, rng.choice(names), rng, outside)


def _load_guarded(acc, d):
    """load_state with a 20 s alarm: a FIFO or a huge loop must not hang the test."""
    def hang(signum, frame):
        raise TimeoutError("load_state hung")
    old = signal.signal(signal.SIGALRM, hang)
    signal.alarm(20)
    try:
        load_state(acc, d)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def _check_outcome(acc, before, want, d, what):
    try:
        _load_guarded(acc, d)
    except CheckpointError as e:
        assert str(e), what
        after = _everything(acc)
        for k in before:
            same(after[k], before[k], f"{what}: {k} changed by a failed load ({e})")
        return "error"
    got = _tensors(acc)
    same(got, want, f"{what}: loaded without error but with other tensors")
    return "same"


@pytest.mark.parametrize("seed", [int(s) for s in os.environ.get("FUZZ_SEEDS", "0,1").split(",")])
def test_fuzzed_checkpoints_load_exactly_or_fail_cleanly(ckpt, tmp_path, seed):
    path, want = ckpt
    rng = random.Random(seed)
    outcomes = {"error": 0, "same": 0}
    for i in range(120):
        d = str(tmp_path / f"m{i}")
        shutil.copytree(path, d, symlinks=True)
        what = _mutation(d, rng, str(tmp_path / f"outside{i}"))
        kind = rng.choice(["whole", "rank0of2"])
        acc = _fresh(kind)
        torch.manual_seed(i)                      # a distinct RNG state to be kept on failure
        acc.step, acc.counter.count = 7, 3
        before = _everything(acc)
        outcomes[_check_outcome(acc, before, want[kind], d, f"mutation {i} ({kind}): {what}")] += 1
        shutil.rmtree(d)
    assert outcomes["error"] > 80, outcomes       # the fuzzer reaches the validators, not only benign fields


# ----------------------------------------------------------------------------------------------- the cases
def _copy(ckpt, tmp_path, name="c"):
    d = str(tmp_path / name)
    shutil.copytree(ckpt[0], d)
    return d


def _fails_cleanly(d, pattern, kind="whole"):
    acc = _fresh(kind)
    before = _everything(acc)
    with pytest.raises(CheckpointError, match=pattern):
        _load_guarded(acc, d)
    after = _everything(acc)
    for k in before:
        same(after[k], before[k], f"{k} changed by a failed load")


def _st_case(ckpt, tmp_path, mutate, pattern, name="model-rank00000-of-00002.safetensors"):
    d = _copy(ckpt, tmp_path, f"st{len(os.listdir(tmp_path))}")
    header, data = _read_st(os.path.join(d, name))
    mutate(header, [k for k in header if k != "__metadata__"])
    _write_st(os.path.join(d, name), header, data)
    rewrite_listed(d, name)
    _fails_cleanly(d, pattern)
    return d


def test_safetensors_offsets_and_shapes_are_validated(ckpt, tmp_path):
    def at(k, v, field="data_offsets"):
        return lambda h, keys: h[keys[k]].__setitem__(field, v(h, keys) if callable(v) else v)
    _st_case(ckpt, tmp_path, at(0, [-200, -72]), r"model-rank00000.*data_offsets")
    def alias(h, keys):                  # entry 1 claims entry 0's bytes (same shape and dtype: sizes agree)
        h[keys[1]] = dict(h[keys[0]])
    _st_case(ckpt, tmp_path, alias, r"overlaps the previous tensor")
    _st_case(ckpt, tmp_path, at(0, [10 ** 12], "shape"), r"shape \[1000000000000\]")
    _st_case(ckpt, tmp_path, at(0, [2 ** 62, 8], "shape"), r"needs")
    d = _st_case(ckpt, tmp_path, at(0, "Q7", "dtype"), r"unknown dtype 'Q7'")
    from accelerate_c.commands.merge_weights import merge_command
    import argparse
    args = argparse.Namespace(checkpoint_directory=d, output_path=str(tmp_path / "merged"), unsafe_serialization=False,
                              remove_checkpoint_dir=False)
    assert merge_command(args) == 1                       # merge-weights refuses it too, writing nothing
    assert not os.path.exists(tmp_path / "merged" / "model.safetensors")


def test_names_stay_inside_the_checkpoint(ckpt, tmp_path):
    d = _copy(ckpt, tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    shutil.copy(os.path.join(d, "scheduler.json"), outside / "x.json")
    meta = json.load(open(os.path.join(d, "checkpoint.json")))
    for field, value in (("schedulers", [str(outside / "x")]), ("schedulers", ["../outside/x"]),
                         ("models", ["../outside/m"]), ("scaler", "/abs/path/x"), ("optimizers", [".optimizer"])):
        open(os.path.join(d, "checkpoint.json"), "w").write(json.dumps(meta | {field: value}))
        _fails_cleanly(d, "not a plain file name inside the checkpoint") if field != "scaler" else None
    open(os.path.join(d, "checkpoint.json"), "w").write(json.dumps(meta))
    # a piece file replaced by a link to a copy outside, a FIFO for scheduler.json: named, and never a hang
    piece = os.path.join(d, "model-rank00001-of-00002.safetensors")
    shutil.move(piece, outside / "piece")
    os.symlink(outside / "piece", piece)
    _fails_cleanly(d, "not a regular file")
    os.remove(piece)
    shutil.copy(outside / "piece", piece)
    os.remove(os.path.join(d, "scheduler.json"))
    os.mkfifo(os.path.join(d, "scheduler.json"))
    _fails_cleanly(d, "scheduler.json is not a regular file")


def test_malformed_metadata_is_named(ckpt, tmp_path):
    d = _copy(ckpt, tmp_path)
    meta = json.load(open(os.path.join(d, "checkpoint.json")))
    for bad, pattern in (({k: v for k, v in meta.items() if k != "step"}, r"checkpoint\.json: 'step' is missing"),
                         (meta | {"step": "3"}, r"checkpoint\.json: step is str '3', expected nat|step is '3'"),
                         (meta | {"models": "model"}, r"checkpoint\.json: models is str"),
                         (meta | {"files": {"model.json": -4}}, r"files\['model.json'\] is -4")):
        open(os.path.join(d, "checkpoint.json"), "w").write(json.dumps(bad))
        _fails_cleanly(d, pattern)
    open(os.path.join(d, "checkpoint.json"), "w").write(json.dumps(meta))
    open(os.path.join(d, "model.json"), "w").write("[" * 200_000 + "]" * 200_000)
    rewrite_listed(d, "model.json")
    _fails_cleanly(d, r"model\.json is not valid JSON: nested too deeply")


def test_later_errors_leave_everything_as_it_was(ckpt, tmp_path):
    """The model is read last: a bad optimizer file, RNG state or missing step found first changes nothing."""
    d = _copy(ckpt, tmp_path)
    _st_case(ckpt, tmp_path, lambda h, keys: h[keys[-1]].__setitem__("dtype", "Q7"), "optimizer-rank00001",
             name="optimizer-rank00001-of-00002.safetensors")
    rng_file = os.path.join(d, "random_states_0.json")
    doc = json.load(open(rng_file))
    doc["data"]["python"] = {"__t__": "tuple", "v": [3, [1, 2], None]}     # not a python RNG state
    open(rng_file, "w").write(json.dumps(doc))
    rewrite_listed(d, "random_states_0.json")
    _fails_cleanly(d, r"random_states_0\.json holds no valid RNG state")
