# tests/test_checkpointing.py: accelerate_c.checkpointing against exact references: encoder round trips
# (type- and bit-exact), save/load of a real model + AdamW + LambdaLR resuming bit-identically to an
# uninterrupted run, exact RNG restore, automatic naming/total_limit, SIGKILL during save, corrupt-file
# errors, no pickle, save_model sharding, and a 2-process gloo save/load.
import json
import os
import pickle
import random
import sys
import time

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from accelerate_c.checkpointing import (CheckpointError, decode, encode, load_state, parse_size, read_checkpoint_info,
                                        read_data_position, read_state, save_model, save_state, write_state)
from accelerate_c.checkpointing import atomic
from accelerate_c.utils.dataclasses import ProjectConfiguration
from bitwise import same
from conftest import Job, describe_all, finish_all, free_port, rewrite_listed

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ----------------------------------------------------------------------------------------------- helpers
class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(11, 8)
        self.lin = torch.nn.Linear(8, 8)
        self.norm = torch.nn.LayerNorm(8)
        self.drop = torch.nn.Dropout(0.3)
        self.head = torch.nn.Linear(8, 11, bias=False)
        self.head.weight = self.emb.weight  # tied
        self.register_buffer("seen", torch.zeros((), dtype=torch.int64))

    def forward(self, idx):
        self.seen += 1
        return self.head(self.drop(self.norm(torch.relu(self.lin(self.emb(idx))))))


class Counter:
    def __init__(self):
        self.count, self.history, self.t = 0, [], torch.zeros(3, dtype=torch.bfloat16)

    def state_dict(self):
        return {"count": self.count, "history": list(self.history), "t": self.t}

    def load_state_dict(self, sd):
        self.count, self.history, self.t = sd["count"], list(sd["history"]), sd["t"]


class FakeLoader:
    def __init__(self):
        self.epoch, self.batches_consumed, self.gen = 0, 0, torch.Generator().manual_seed(5)

    def state_dict(self):
        return {"epoch": self.epoch, "batches_consumed": self.batches_consumed, "generator": self.gen.get_state()}

    def load_state_dict(self, sd):
        self.epoch, self.batches_consumed = sd["epoch"], sd["batches_consumed"]
        self.gen.set_state(sd["generator"])


class OptWrap:  # stands in for AcceleratedOptimizer
    def __init__(self, opt):
        self.optimizer = opt

    def state_dict(self):
        return self.optimizer.state_dict()

    def load_state_dict(self, sd):
        self.optimizer.load_state_dict(sd)


class FakeAccelerator:
    """Only the attributes accelerate_c.checkpointing may use."""

    def __init__(self, seed=0, project_dir=None, auto=False, total_limit=None, rank=0, world=1, barrier=None,
                 stateful=False, scaler=None):
        torch.manual_seed(seed)
        self.model = Net()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2, weight_decay=0.1)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: 1.0 / (1 + s))
        self.loader, self.counter = FakeLoader(), Counter()
        self._models, self._optimizers, self._schedulers = [self.model], [OptWrap(self.opt)], [self.sched]
        self._dataloaders, self._custom_objects = [self.loader], [self.counter]
        self.scaler, self.step = scaler, 0
        self.project_configuration = ProjectConfiguration(project_dir=project_dir, automatic_checkpoint_naming=auto,
                                                          total_limit=total_limit)
        self.use_stateful_dataloader = stateful
        self.process_index, self.num_processes = rank, world
        self._barrier = barrier
        self._save_model_state_pre_hook, self._load_model_state_pre_hook = {}, {}

    @property
    def is_main_process(self):
        return self.process_index == 0

    def wait_for_everyone(self):
        if self._barrier:
            self._barrier()

    def unwrap_model(self, model, keep_fp32_wrapper=True, keep_torch_compile=True):
        return getattr(model, "module", model)

    def get_state_dict(self, model):
        return self.unwrap_model(model).state_dict()


def train(acc, n):
    losses = []
    for _ in range(n):
        idx = torch.randint(0, 11, (4, 5))
        loss = torch.nn.functional.cross_entropy(acc.model(idx).reshape(-1, 11), idx.reshape(-1))
        loss = loss + 1e-3 * random.random() + 1e-3 * float(np.random.rand())
        acc.opt.zero_grad()
        loss.backward()
        acc.opt.step()
        acc.sched.step()
        acc.step += 1
        acc.loader.batches_consumed += 1
        acc.counter.count += 1
        acc.counter.history.append(loss.item())
        losses.append(loss.item())
    return losses


# ----------------------------------------------------------------------------------------------- encoder
def sample_object():
    base = torch.arange(12, dtype=torch.float32)
    return {
        "none": None, "b": True, "i": -(2 ** 70), "f": 0.1, "negzero": -0.0, "nan": float("nan"),
        "inf": float("inf"), "ninf": float("-inf"), "s": "__t__ tricky", "list": [1, 2.0, [3, (4, None)]],
        "tuple": (1, (2, 3), []), "empty": {}, "int_keys": {0: {"step": torch.tensor(3.0)}, 7: "x"},
        "mixed_keys": {1: "a", "1": "b", (2, 3): "c", None: "d", 2.5: "e", False: "f"},
        "reserved": {"__t__": "tensor", "key": "t0"},
        "scalar0d": torch.tensor(7, dtype=torch.int64), "bf16": torch.randn(3, 4).to(torch.bfloat16),
        "f16": torch.randn(2).half(), "boolt": torch.tensor([True, False]), "u8": torch.arange(5, dtype=torch.uint8),
        "empty_t": torch.empty(0, 3), "view": base[2:6], "strided": base.reshape(3, 4).t(), "base": base,
        "same_twice": [base, base], "f64nan": torch.tensor([float("nan"), float("inf"), -0.0], dtype=torch.float64),
        "np": np.random.RandomState(3).get_state(), "np_f32": np.arange(6, dtype=np.float32).reshape(2, 3),
        "np_scalars": [np.int64(5), np.float32(1.5), np.float64(float("nan")), np.bool_(True)],
        "bytes": b"\x00\xffab", "dtype": torch.bfloat16, "device": torch.device("cpu"),
        "py_rng": random.Random(4).getstate(),
    }


def test_encode_roundtrip_memory_and_disk(tmp_path):
    obj = sample_object()
    data, tensors = encode(obj)
    text = json.dumps(data, allow_nan=False)  # strict JSON
    same(obj, decode(json.loads(text), tensors))
    write_state(str(tmp_path), "obj", obj, kind="test")
    back = read_state(str(tmp_path), "obj", kind="test")
    same(obj, back)
    assert back["same_twice"][0] is back["same_twice"][1]
    assert back["view"].data_ptr() != back["base"].data_ptr()


def test_encode_rejects_unknown_types():
    with pytest.raises(TypeError, match=r"state\.a\[1\].*object"):
        encode({"a": [1, object()]})


# ----------------------------------------------------------------------------------------------- save/load
def test_resume_is_bit_identical(tmp_path):
    ref = FakeAccelerator(seed=0)
    ref.scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=7)
    train(ref, 3)
    ckpt = save_state(ref, str(tmp_path / "ck"))
    saved_sd = {k: v.clone() for k, v in ref.model.state_dict().items()}
    after_save_rng = (random.random(), float(np.random.rand()), torch.rand(3))
    ref_losses = train(ref, 4)

    new = FakeAccelerator(seed=123, stateful=True)  # different init, different RNG
    new.scaler = torch.amp.GradScaler("cpu", init_scale=2.0)
    assert load_state(new, ckpt) == ckpt
    assert new.step == 3 and new.scaler.get_scale() == 1024.0 and new.scaler.get_growth_interval() == 7
    same((random.random(), float(np.random.rand()), torch.rand(3)), after_save_rng)  # same draws as ref's
    assert new.loader.batches_consumed == 3 and new.counter.count == 3
    same(new.counter.state_dict(), {"count": 3, "history": ref.counter.history[:3], "t": ref.counter.t})
    new_losses = train(new, 4)
    assert new_losses == ref_losses
    same(dict(new.model.state_dict()), dict(ref.model.state_dict()))
    same(new.opt.state_dict(), ref.opt.state_dict())
    same(new.sched.state_dict(), ref.sched.state_dict())
    assert new.model.head.weight is new.model.emb.weight  # tie survives loading
    plain = Net()  # the model file is plain safetensors: safetensors' own loader (HF's path) reads it
    import safetensors.torch
    safetensors.torch.load_model(plain, os.path.join(ckpt, "model.safetensors"))
    same(dict(plain.state_dict()), saved_sd)


def test_data_position_saved_but_restored_only_when_stateful(tmp_path):
    acc = FakeAccelerator()
    acc.loader.epoch, acc.loader.batches_consumed = 2, 17
    ckpt = save_state(acc, str(tmp_path / "ck"))
    pos = read_data_position(ckpt)
    assert (pos.epoch, pos.batches_consumed, pos.samples_consumed) == (2, 17, None)
    assert read_checkpoint_info(ckpt)["data_position"] == [{"epoch": 2, "batches_consumed": 17,
                                                             "samples_consumed": None}]
    plain = FakeAccelerator()
    load_state(plain, ckpt)
    assert (plain.loader.epoch, plain.loader.batches_consumed) == (0, 0)
    stateful = FakeAccelerator(stateful=True)
    load_state(stateful, ckpt)
    assert (stateful.loader.epoch, stateful.loader.batches_consumed) == (2, 17)


def test_deepspeed_only_save_keywords_are_named(tmp_path, caplog):
    # save_state's extra keywords (HF hands them to DeepSpeed's save_checkpoint) were dropped without a word
    import logging
    with caplog.at_level(logging.WARNING):
        save_state(FakeAccelerator(), str(tmp_path / "ck"), exclude_frozen_parameters=True, tag="t")
    assert "have no effect in accelerate_c" in caplog.text and "exclude_frozen_parameters, tag" in caplog.text


def test_hooks_custom_count_and_map_location(tmp_path):
    acc = FakeAccelerator()
    seen = {}

    def save_hook(models, weights, output_dir):
        seen["save"] = (len(models), len(weights), output_dir)
        with open(os.path.join(output_dir, "extra.txt"), "w") as f:
            f.write("hook")

    acc._save_model_state_pre_hook[0] = save_hook
    ckpt = save_state(acc, str(tmp_path / "ck"))
    assert seen["save"][:2] == (1, 1) and open(os.path.join(ckpt, "extra.txt")).read() == "hook"
    new = FakeAccelerator()
    new._load_model_state_pre_hook[0] = lambda models, d: seen.setdefault("load", (len(models), d))
    load_state(new, ckpt, strict=True)
    assert seen["load"] == (1, ckpt)
    with pytest.raises(TypeError):
        load_state(new, ckpt, map_location="cuda:3")
    new._custom_objects.append(Counter())
    with pytest.raises(RuntimeError, match="custom checkpoints"):
        load_state(new, ckpt)


def test_resave_same_dir_keeps_foreign_files_drops_stale(tmp_path):
    acc = FakeAccelerator()
    ckpt = save_state(acc, str(tmp_path / "ck"))
    with open(os.path.join(ckpt, "notes.txt"), "w") as f:
        f.write("mine")
    acc._schedulers.append(torch.optim.lr_scheduler.LambdaLR(acc.opt, lambda s: 1.0))
    save_state(acc, ckpt)
    assert os.path.isfile(os.path.join(ckpt, "scheduler_1.json"))
    acc._schedulers.pop()
    acc.step = 9
    save_state(acc, ckpt)
    names = set(os.listdir(ckpt))
    assert "notes.txt" in names and "scheduler_1.json" not in names
    assert read_checkpoint_info(ckpt)["step"] == 9
    assert not [n for n in os.listdir(tmp_path) if atomic.is_internal_name(n)]


def test_automatic_naming_and_total_limit(tmp_path, monkeypatch):
    acc = FakeAccelerator(project_dir=str(tmp_path), auto=True, total_limit=2)
    root = tmp_path / "checkpoints"
    os.makedirs(root / ".checkpoint_0.accelerate_c-tmp")  # leftover of a crashed save
    for step in range(4):
        acc.step = step * 10
        save_state(acc)
    assert sorted(os.listdir(root)) == ["checkpoint_2", "checkpoint_3"]
    assert acc.project_configuration.iteration == 4
    new = FakeAccelerator(project_dir=str(tmp_path), auto=True)
    assert load_state(new).endswith("checkpoint_3") and new.step == 30
    acc.project_configuration.iteration = 3
    with pytest.raises(ValueError, match="already exists"):
        save_state(acc)
    os.makedirs(root / "checkpoint_9")  # incomplete (no checkpoint.json): never picked
    assert load_state(new).endswith("checkpoint_3")
    # a save killed while rotation deletes the oldest: the half-deleted checkpoint is never listed as complete
    from accelerate_c.checkpointing import directory
    real_rmtree = directory.shutil.rmtree

    def killed(path, *a, **k):
        if "checkpoint_2" in str(path):
            os.remove(os.path.join(path, "model.safetensors"))     # part of it gone, then the "kill"
            raise KeyboardInterrupt
        return real_rmtree(path, *a, **k)
    acc.project_configuration.iteration = 10
    monkeypatch.setattr(directory.shutil, "rmtree", killed)
    with pytest.raises(KeyboardInterrupt):
        save_state(acc)
    monkeypatch.undo()
    listed = [os.path.basename(p) for _, p in directory.list_checkpoints(str(root))]
    assert "checkpoint_2" not in listed and "checkpoint_10" in listed, listed


# ----------------------------------------------------------------------------------------------- errors
def test_clear_errors_for_bad_files(tmp_path):
    acc = FakeAccelerator()
    train(acc, 1)
    ckpt = save_state(acc, str(tmp_path / "ck"))

    def broken(mutate, pattern):
        d = str(tmp_path / f"b{len(os.listdir(tmp_path))}")
        import shutil
        shutil.copytree(ckpt, d)
        mutate(d)
        with pytest.raises(CheckpointError, match=pattern):
            load_state(FakeAccelerator(), d)

    def truncate(name, keep=0.5):
        def f(d):
            p = os.path.join(d, name)
            data = open(p, "rb").read()
            open(p, "wb").write(data[: int(len(data) * keep)])
        return f

    def write(name, text):  # replaces a file and its listed size, so the reader sees the new content itself
        return lambda d: rewrite_listed(d, name, text)

    broken(truncate("optimizer.safetensors"), r"optimizer\.safetensors.*truncated")
    broken(truncate("model.safetensors"), r"model\.safetensors")
    broken(truncate("optimizer.json"), r"optimizer\.json.*truncated")
    broken(write("scheduler.json", "\x00garbage{"), r"scheduler\.json.*not valid JSON")
    broken(write("scheduler.json", '{"hello": 1}'), r"scheduler\.json.*not an accelerate_c state file")
    broken(lambda d: os.remove(os.path.join(d, "random_states_0.json")), r"random_states_0\.json.*missing")
    meta = json.load(open(os.path.join(ckpt, "checkpoint.json")))
    broken(write("checkpoint.json", json.dumps(meta | {"version": 99})), r"checkpoint\.json.*version 99")
    doc = json.load(open(os.path.join(ckpt, "optimizer.json")))
    broken(write("optimizer.json", json.dumps(doc | {"version": 2})), r"optimizer\.json.*version 2")
    broken(lambda d: os.remove(os.path.join(d, "checkpoint.json")), r"checkpoint\.json is missing")
    with pytest.raises(ValueError, match="does not exist"):
        load_state(FakeAccelerator(), str(tmp_path / "nope"))


def test_no_pickle_written_or_read(tmp_path, monkeypatch):
    acc = FakeAccelerator()
    acc.scaler = torch.amp.GradScaler("cpu")
    train(acc, 2)
    ckpt = save_state(acc, str(tmp_path / "ck"))
    for name in os.listdir(ckpt):
        assert name.endswith((".json", ".safetensors")), name
        with open(os.path.join(ckpt, name), "rb") as f:
            assert b"\x80\x04\x95" not in f.read(64), name  # no pickle protocol-4 header

    def boom(*a, **k):
        raise AssertionError("unpickling attempted")

    for mod, attr in ((pickle, "loads"), (pickle, "load"), (pickle, "Unpickler"), (torch, "load")):
        monkeypatch.setattr(mod, attr, boom)
    new = FakeAccelerator(seed=9)
    new.scaler = torch.amp.GradScaler("cpu")
    load_state(new, ckpt)
    same(dict(new.model.state_dict()), dict(acc.model.state_dict()))


# ----------------------------------------------------------------------------------------------- atomicity
KILL_SCRIPT = """
import os, sys, time
sys.path.insert(0, {repo!r}); sys.path.insert(0, {tests!r})
from test_checkpointing import FakeAccelerator
from accelerate_c.checkpointing import save_state, session as state, atomic
mode, ckpt, flag = sys.argv[1], sys.argv[2], sys.argv[3]
acc = FakeAccelerator(seed=1)
acc.step = 2
def stall():
    open(flag, "w").close()
    time.sleep(60)
if mode == "write":
    real = state.write_state
    def slow(d, name, obj, kind):
        out = real(d, name, obj, kind)
        if name == "scheduler":  # after the model and optimizer pieces
            stall()
        return out
    state.write_state = slow
else:  # between the two renames of the replace fallback
    atomic._exchange = lambda a, b: False
    real_rename = os.rename
    def rename(src, dst):
        real_rename(src, dst)
        if os.path.abspath(src) == os.path.abspath(ckpt):
            stall()
    atomic.os.rename = rename
save_state(acc, ckpt)
"""


@pytest.mark.parametrize("mode", ["write", "rename"])
def test_sigkill_during_save_leaves_a_complete_checkpoint(tmp_path, mode):
    ckpt, flag = str(tmp_path / "ck"), str(tmp_path / "flag")
    old = FakeAccelerator(seed=0)
    old.step = 1
    save_state(old, ckpt)
    script = tmp_path / "kill.py"
    script.write_text(KILL_SCRIPT.format(repo=REPO, tests=os.path.dirname(__file__)))
    job = Job([sys.executable, str(script), mode, ckpt, flag], str(tmp_path / "logs"), "kill")
    try:
        deadline = time.monotonic() + 300  # a guard against a hang, not a timing check
        while not os.path.exists(flag):
            assert job.poll() is None and time.monotonic() < deadline, \
                "child ended (or hung) before reaching the kill point\n" + job.describe()
            time.sleep(0.05)
    finally:
        job.kill_tree()
    new = FakeAccelerator(seed=5)
    load_state(new, ckpt)
    if mode == "write":  # the old checkpoint, untouched
        assert new.step == 1
        same(dict(new.model.state_dict()), dict(old.model.state_dict()))
        assert os.path.isdir(atomic.temp_dir_for(ckpt))
    else:  # the new one was complete in the temp dir: chosen over the old one set aside
        assert new.step == 2 and os.path.isdir(atomic.old_dir_for(ckpt))
    old.step = 3
    save_state(old, ckpt)  # cleans up
    assert sorted(n for n in os.listdir(tmp_path) if n.startswith(".")) == []
    load_state(new, ckpt)
    assert new.step == 3


# ----------------------------------------------------------------------------------------------- save_model
def test_parse_size():
    assert parse_size("10GB") == 10 ** 10 and parse_size("500MB") == 5 * 10 ** 8 and parse_size(123) == 123
    assert parse_size("1GiB") == 2 ** 30 and parse_size("1.5KB") == 1500
    for bad in ("10", "GB", "10XB", 0, -1):
        with pytest.raises(ValueError):
            parse_size(bad)


def test_save_model_shards_index_tied_and_stale(tmp_path):
    acc = FakeAccelerator()
    sd = acc.model.state_dict()
    out = str(tmp_path / "m")
    save_model(acc, acc.model, out, max_shard_size=300)
    index = json.load(open(os.path.join(out, "model.safetensors.index.json")))
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 3 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert "head.weight" not in index["weight_map"]  # tied to emb.weight: stored once
    loaded = {}
    for s in shards:
        loaded.update(load_file(os.path.join(out, s)))
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in loaded.values())
    for k, v in loaded.items():
        same(v, sd[k].contiguous())
    save_model(acc, acc.model, out)  # one file now: stale shards and index removed
    assert sorted(os.listdir(out)) == ["model.safetensors"]
    assert set(load_file(os.path.join(out, "model.safetensors"))) == set(sd) - {"head.weight"}
    acc.process_index = 1
    save_model(acc, acc.model, str(tmp_path / "other"))
    assert not os.path.exists(tmp_path / "other")


class FlatNet(torch.nn.Module):
    """Parameters are views into one flat buffer (accelerate_c's memory model)."""

    def __init__(self, fill):
        super().__init__()
        self.flat = torch.full((20,), float(fill))
        self.flat.copy_(torch.arange(20.0) * fill)
        self.a = torch.nn.Parameter(self.flat[:12].view(3, 4))
        self.b = torch.nn.Parameter(self.flat[12:])


def test_flat_buffer_views_are_all_saved(tmp_path):
    acc = FakeAccelerator()
    net = FlatNet(1.0)
    acc._models = [net]
    acc._optimizers, acc._schedulers = [], []
    save_model(acc, net, str(tmp_path / "m"), max_shard_size=50)
    loaded = {}
    for f in os.listdir(tmp_path / "m"):
        if f.endswith(".safetensors"):
            loaded.update(load_file(str(tmp_path / "m" / f)))
    same(loaded, {"a": net.a.detach().clone(), "b": net.b.detach().clone()})
    ckpt = save_state(acc, str(tmp_path / "ck"))
    other = FlatNet(2.0)
    acc._models = [other]
    load_state(acc, ckpt)
    same(dict(other.state_dict()), dict(net.state_dict()))


# ----------------------------------------------------------------------------------------------- 2 processes
GLOO_SCRIPT = """
import os, sys, random, json
import numpy as np, torch, torch.distributed as dist
sys.path.insert(0, {repo!r}); sys.path.insert(0, {tests!r})
from test_checkpointing import FakeAccelerator, same
from accelerate_c.checkpointing import save_state, load_state
rank, port, out, single = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{{port}}", rank=rank, world_size=2)
acc = FakeAccelerator(seed=0, rank=rank, world=2, barrier=dist.barrier)
random.seed(100 + rank); np.random.seed(100 + rank); torch.manual_seed(100 + rank)
acc.step = 4
ckpt = save_state(acc, out)
draws = (random.random(), float(np.random.rand()), torch.rand(4))
torch.rand(10); random.random()
new = FakeAccelerator(seed=7, rank=rank, world=2, barrier=dist.barrier)
load_state(new, ckpt)
same((random.random(), float(np.random.rand()), torch.rand(4)), draws)
assert new.step == 4
same(dict(new.model.state_dict()), dict(acc.model.state_dict()))
# A checkpoint saved by one process, loaded by two: rank 1 has no RNG file and keeps its state.
other = FakeAccelerator(seed=7, rank=rank, world=2, barrier=dist.barrier)
before = torch.get_rng_state().clone()
load_state(other, single)
if rank == 1:
    assert torch.equal(torch.get_rng_state(), before)
dist.barrier()
dist.destroy_process_group()
print("OK", rank, flush=True)
os._exit(0)  # no interpreter teardown: it can race torch's gloo worker threads (see _bootstrap.py)
"""


def test_two_process_gloo_rng_per_rank(tmp_path):
    single = save_state(FakeAccelerator(seed=3), str(tmp_path / "single"))
    script = tmp_path / "gloo.py"
    script.write_text(GLOO_SCRIPT.format(repo=REPO, tests=os.path.dirname(__file__)))
    out = str(tmp_path / "ck")
    port = str(free_port())
    jobs = [Job([sys.executable, str(script), str(r), port, out, single], str(tmp_path / "logs"), f"rank{r}")
            for r in range(2)]
    results = finish_all(jobs, 300)  # output in files, both shown on failure; a hang is killed at the guard
    for r, (rc, text, _) in enumerate(results):
        assert rc == 0 and f"OK {r}" in text, describe_all(jobs)
    assert {"random_states_0.json", "random_states_1.json", "dataloader_states_1.json"} <= set(os.listdir(out))
    assert read_checkpoint_info(out)["world_size"] == 2
    # 2-process checkpoint loaded by one process: model/optimizer restored, warns about the world size.
    new = FakeAccelerator(seed=11)
    load_state(new, out)
    same(dict(new.model.state_dict()), dict(FakeAccelerator(seed=0).model.state_dict()))
