# tests/test_checkpoint_universal.py: universal checkpoints against exact references. A checkpoint saved under
# one layout and world size loads under any other with bitwise-equal logical tensors (model and optimizer state
# by parameter name) and the run resumes exactly: the unsharded default with 2 gloo processes -> a fake flat-shard
# strategy (every tensor split in N contiguous ranges, padded, empty pieces allowed: the contract the sharded
# engine implements) with 3 processes -> one process, and back to 2. Also: each rank writes only its own pieces,
# missing pieces/files give errors that name them, 8-bit / bf16 optimizer state by element and block range,
# save_model's HF-sharded output read by transformers and HF accelerate, and `merge-weights`.
# Not for: the state-file encoder, atomicity, RNG/data position (test_checkpointing.py).
import json
import os
import random
import subprocess
import sys

import numpy as np
import pytest
import torch

from accelerate_c.checkpointing import CheckpointError, load_state, save_model, save_state
from accelerate_c.checkpointing.slices import ParamSlot, TensorSlice
from bitwise import same
from conftest import Job, clean_env, describe_all, finish_all, free_port, rewrite_listed
from test_checkpointing import FakeAccelerator, OptWrap, train

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.dirname(os.path.abspath(__file__))


# ----------------------------------------------------------------------------------------------- fake sharding
class FlatShards:
    """A stand-in for the sharded engine's layout: every logical tensor flattened, padded to a multiple of
    world * align elements and cut into `world` equal contiguous ranges; rank r holds range r (possibly empty or
    short). Model slices are views of the model's tensors; the optimizer steps 1-D copies of the ranges."""

    def __init__(self, rank: int, world: int, align: int = 1):
        self.rank, self.world, self.align, self.names = rank, world, align, []

    def range(self, n: int) -> tuple[int, int]:
        chunk = -(-n // (self.world * self.align)) * self.align
        return min(self.rank * chunk, n), min((self.rank + 1) * chunk, n)

    def model_slices(self, model):
        out = []
        for k, t in model.state_dict(keep_vars=True).items():
            lo, hi = self.range(t.numel())
            out.append(TensorSlice(k, tuple(t.shape), t.dtype, lo, t.detach().view(-1)[lo:hi]))
        return out

    def shard_params(self, model):
        named = list(model.named_parameters())
        self.names = [(n, tuple(p.shape)) for n, p in named]
        return [torch.nn.Parameter(p.detach().view(-1)[slice(*self.range(p.numel()))].clone()) for _, p in named]

    def optimizer_layout(self, optimizer, model):
        out = []
        for i, (n, shape) in enumerate(self.names):
            lo, hi = self.range(int(torch.Size(shape).numel()))
            out.append(ParamSlot(i, n, shape, lo, hi - lo, (hi - lo,)))
        return out


def sharded(acc, rank, world, align=1, opt_cls=torch.optim.AdamW, **kw):
    """Turns a FakeAccelerator into a rank of the fake sharded layout (optimizer over the shard pieces)."""
    acc.strategy = FlatShards(rank, world, align)
    acc.opt = opt_cls(acc.strategy.shard_params(acc.model), **(kw or {"lr": 1e-2, "weight_decay": 0.1}))
    acc.sched = torch.optim.lr_scheduler.LambdaLR(acc.opt, lambda s: 1.0 / (1 + s))
    acc._optimizers, acc._schedulers = [OptWrap(acc.opt)], [acc.sched]
    return acc


def reference(steps=3):
    """The single-layout run the checkpoints come from, computed again here. One thread, as in the gloo ranks
    (OMP_NUM_THREADS=1): CPU reductions with other thread counts round differently."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ref = FakeAccelerator(seed=0)
        train(ref, steps)
    finally:
        torch.set_num_threads(threads)
    return ref


def reseed(acc, seed=123):
    """The same data and dropout draws for two runs continuing from the same state."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    return acc


def check_sharded_rank(acc, ref):
    """This rank's model pieces and optimizer slot state are exactly the reference's ranges."""
    rsd = ref.model.state_dict()
    for s in acc.strategy.model_slices(acc.model):
        same(s.data.clone(), rsd[s.name].reshape(-1)[s.start:s.start + s.numel].clone(), f"model {s.name}")
    ref_state = ref.opt.state_dict()["state"]
    names = [n for n, _ in ref.model.named_parameters()]
    for slot in acc.strategy.optimizer_layout(acc.opt, acc.model):
        got, want = acc.opt.state_dict()["state"][slot.index], ref_state[names.index(slot.name)]
        same(got["step"], want["step"], f"{slot.name} step")
        for k in ("exp_avg", "exp_avg_sq"):
            same(got[k], want[k].reshape(-1)[slot.start:slot.start + slot.numel].clone(), f"{slot.name}/{k}")
    assert acc.opt.param_groups[0]["lr"] == ref.opt.param_groups[0]["lr"]
    same(acc.sched.state_dict(), ref.sched.state_dict())


# ----------------------------------------------------------------------------------------------- gloo runs
SCRIPT = """
import os, sys
import torch, torch.distributed as dist
sys.path.insert(0, {repo!r}); sys.path.insert(0, {tests!r})
from test_checkpoint_universal import FakeAccelerator, sharded, reference, check_sharded_rank, train, same
from accelerate_c.checkpointing import save_state, load_state
rank, world, port, layout, src, dst = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5], sys.argv[6]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{{port}}", rank=rank, world_size=world)
ref = reference()
if src == "-":                        # the run itself: train 3 steps under the default layout
    acc = FakeAccelerator(seed=0, rank=rank, world=world, barrier=dist.barrier)
    train(acc, 3)
else:
    acc = FakeAccelerator(seed=50 + rank, rank=rank, world=world, barrier=dist.barrier)
    if layout == "sharded":
        sharded(acc, rank, world)
    load_state(acc, src)
    if layout == "sharded":
        check_sharded_rank(acc, ref)
    else:
        same(dict(acc.model.state_dict()), dict(ref.model.state_dict()))
        same(acc.opt.state_dict(), ref.opt.state_dict())
    assert acc.step == 3
save_state(acc, dst)
dist.barrier()
dist.destroy_process_group()
print("OK", rank, flush=True)
os._exit(0)  # no interpreter teardown: it can race torch's gloo worker threads (see _bootstrap.py)
"""


def gloo(tmp_path, name, world, layout, src, dst):
    script = tmp_path / "universal.py"
    script.write_text(SCRIPT.format(repo=REPO, tests=TESTS))
    port = str(free_port())
    jobs = [Job([sys.executable, str(script), str(r), str(world), port, layout, src, dst],
                str(tmp_path / "logs"), f"{name}-rank{r}", env=clean_env()) for r in range(world)]
    for r, (rc, out, _) in enumerate(finish_all(jobs, 300)):
        assert rc == 0 and f"OK {r}" in out, describe_all(jobs)


def test_any_layout_any_world_size_bitwise(tmp_path):
    ck2, ck3, ck2b = (str(tmp_path / n) for n in ("ddp2", "shard3", "ddp2b"))
    gloo(tmp_path, "ddp2", 2, "default", "-", ck2)
    files = sorted(os.listdir(ck2))
    assert "model-rank00000-of-00002.safetensors" in files and "optimizer-rank00001-of-00002.safetensors" in files
    idx = json.load(open(os.path.join(ck2, "model.json")))
    writers = {p[0] for e in idx["tensors"].values() for p in e["pieces"]}
    assert writers == {"model-rank00000-of-00002.safetensors", "model-rank00001-of-00002.safetensors"}
    assert idx["aliases"] == {"head.weight": "emb.weight"}

    gloo(tmp_path, "shard3", 3, "sharded", ck2, ck3)          # 2 x default -> 3 x sharded, saved again
    idx = json.load(open(os.path.join(ck3, "optimizer.json")))
    pieces = idx["tensors"]["lin.weight/exp_avg"]["pieces"]   # 64 elements padded to 66: 22 + 22 + 20
    assert [(p[2], p[3]) for p in pieces] == [(0, 22), (22, 22), (44, 20)]
    assert [len(g["params"]) for g in idx["param_groups"]] == [5]

    ref = reference()
    saved = {k: v.clone() for k, v in ref.model.state_dict().items()}
    after = train(reseed(ref), 4)
    for src in (ck2, ck3):                                     # -> one process: bitwise, and the run resumes
        one = FakeAccelerator(seed=77)
        load_state(one, src)
        same(dict(one.model.state_dict()), saved)
        assert one.model.head.weight is one.model.emb.weight
        assert train(reseed(one), 4) == after
        same(dict(one.model.state_dict()), dict(ref.model.state_dict()))
        same(one.opt.state_dict(), ref.opt.state_dict())

    gloo(tmp_path, "back2", 2, "default", ck3, ck2b)         # 3 x sharded -> 2 x default

    for world in (1, 2, 4):                                     # any rank of any sharded world reads its ranges
        for rank in range(world):
            acc = sharded(FakeAccelerator(seed=9), rank, world)
            load_state(acc, ck3)
            check_sharded_rank(acc, reference())


def test_missing_pieces_and_files_are_named(tmp_path):
    acc = FakeAccelerator()
    train(acc, 1)
    ck = save_state(acc, str(tmp_path / "ck"))
    def with_extra(acc):                                      # a model with a tensor the checkpoint lacks
        acc.model.extra = torch.nn.Parameter(torch.zeros(3))
        return acc
    with pytest.raises(RuntimeError, match="Missing key.*extra"):   # as strict load_state_dict names it
        load_state(with_extra(FakeAccelerator()), ck)
    with pytest.raises(CheckpointError, match="extra"):   # so does the range loader
        load_state(sharded(with_extra(FakeAccelerator()), 0, 2), ck)
    doc = json.load(open(os.path.join(ck, "model.json")))
    good = json.dumps(doc)
    del doc["tensors"]["lin.bias"]
    rewrite_listed(ck, "model.json", json.dumps(doc))  # an index that disagrees with the piece headers
    with pytest.raises(CheckpointError, match=r"model\.json does not match the piece files"):
        load_state(FakeAccelerator(), ck)
    rewrite_listed(ck, "model.json", good)
    os.remove(os.path.join(ck, "optimizer.safetensors"))
    with pytest.raises(CheckpointError, match=r"optimizer\.safetensors is missing"):
        load_state(FakeAccelerator(), ck, strict=False)
    meta = json.load(open(os.path.join(ck, "checkpoint.json")))
    rewrite_listed(ck, "checkpoint.json", json.dumps(meta | {"version": 1}))
    with pytest.raises(CheckpointError, match="version 1.*universal"):
        load_state(FakeAccelerator(), ck)


def test_pieces_must_cover_each_tensor_once(tmp_path):
    from accelerate_c.checkpointing.pieces import build_index
    metas = [{"pieces": {"w@0": ["w", 0, 4]}}, {"pieces": {"w@6": ["w", 6, 4]}}]
    with pytest.raises(CheckpointError, match=r"'w': elements \[4, 6\) written by no rank"):
        build_index("d", ["a", "b"], metas, {"w": ([10], "float32")})
    metas[1]["pieces"] = {"w@3": ["w", 3, 7]}
    with pytest.raises(CheckpointError, match=r"'w': elements \[3, 4\) written twice"):
        build_index("d", ["a", "b"], metas, {"w": ([10], "float32")})


@pytest.mark.parametrize("state_dtype", ["8bit", "bf16"])
def test_low_precision_state_by_element_and_block_range(tmp_path, state_dtype):
    from accelerate_c.optim import AdamW
    kw = dict(lr=1e-2, state_dtype=state_dtype, min_8bit_size=16)
    torch.manual_seed(0)
    ref = FakeAccelerator(seed=0)
    ref.model.emb = torch.nn.Embedding(300, 8)        # 2400 elements: several 256-blocks
    ref.model.head.weight = ref.model.emb.weight
    ref.opt = AdamW(ref.model.parameters(), **kw)
    ref._optimizers = [OptWrap(ref.opt)]
    for _ in range(2):
        ref.opt.zero_grad()
        ref.model(torch.randint(0, 11, (4, 5))).square().mean().backward()
        ref.opt.step()
    ck = save_state(ref, str(tmp_path / "ck"))
    names = [n for n, _ in ref.model.named_parameters()]
    want = ref.opt.state_dict()["state"][names.index("emb.weight")]
    if state_dtype == "8bit":
        assert want["exp_avg"].dtype == torch.uint8 and want["exp_avg_absmax"].numel() == 10
    for rank in range(3):
        acc = FakeAccelerator(seed=4)
        acc.model.emb = torch.nn.Embedding(300, 8)
        acc.model.head.weight = acc.model.emb.weight
        sharded(acc, rank, 3, align=256, opt_cls=AdamW, **kw)
        load_state(acc, ck)
        slot = [s for s in acc.strategy.optimizer_layout(acc.opt, acc.model) if s.name == "emb.weight"][0]
        got = acc.opt.state_dict()["state"][slot.index]
        for k, t in want.items():
            if k == "step":
                same(got[k], t)
            elif k.endswith("_absmax"):
                same(got[k], t[slot.start // 256: slot.start // 256 + -(-slot.numel // 256)].clone(), k)
            else:
                same(got[k], t.reshape(-1)[slot.start:slot.start + slot.numel].clone(), k)
    if state_dtype == "8bit":                       # 2400 / 3 = 800: not on a block boundary
        acc = FakeAccelerator(seed=4)
        acc.model.emb = torch.nn.Embedding(300, 8)
        acc.model.head.weight = acc.model.emb.weight
        sharded(acc, 1, 3, align=1, opt_cls=AdamW, **kw)
        with pytest.raises(CheckpointError, match=r"emb\.weight.*exp_avg_absmax.*\[800, 1600\).*256"):
            load_state(acc, ck)


# ----------------------------------------------------------------------------------------------- exports
def tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=16))


def test_save_model_hf_shards_load_in_transformers_and_hf_accelerate(tmp_path):
    from accelerate.utils import load_checkpoint_in_model
    from transformers import GPT2LMHeadModel
    model = tiny_gpt2()
    acc = FakeAccelerator()
    out = str(tmp_path / "m")
    save_model(acc, model, out, max_shard_size="20KB")
    model.config.save_pretrained(out)                 # save_model writes weights only, as HF's does
    index = json.load(open(os.path.join(out, "model.safetensors.index.json")))
    assert len(set(index["weight_map"].values())) > 2
    back = GPT2LMHeadModel.from_pretrained(out)
    same(dict(back.state_dict()), dict(model.state_dict()))
    other = tiny_gpt2()
    torch.nn.init.zeros_(other.transformer.h[0].mlp.c_fc.weight)
    load_checkpoint_in_model(other, out)
    same(dict(other.state_dict()), dict(model.state_dict()))


SAVE_MODEL_SCRIPT = """
import os, sys
import torch, torch.distributed as dist
sys.path.insert(0, {repo!r}); sys.path.insert(0, {tests!r})
from test_checkpoint_universal import FakeAccelerator, FlatShards
from accelerate_c.checkpointing import save_model
rank, world, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{{port}}", rank=rank, world_size=world)
acc = FakeAccelerator(seed=0, rank=rank, world=world, barrier=dist.barrier)
save_model(acc, acc.model, out + "-whole", max_shard_size=300)   # default layout: shard j written by rank j % 3
acc.strategy = FlatShards(rank, world)
save_model(acc, acc.model, out, max_shard_size=300)
dist.barrier()
dist.destroy_process_group()
print("OK", rank, flush=True)
os._exit(0)
"""


def test_save_model_from_sharded_ranks(tmp_path):
    from safetensors.torch import load_file
    script = tmp_path / "save_model.py"
    script.write_text(SAVE_MODEL_SCRIPT.format(repo=REPO, tests=TESTS))
    out, port = str(tmp_path / "m"), str(free_port())
    jobs = [Job([sys.executable, str(script), str(r), "3", port, out], str(tmp_path / "logs"), f"rank{r}",
                env=clean_env()) for r in range(3)]
    for r, (rc, text, _) in enumerate(finish_all(jobs, 300)):
        assert rc == 0 and f"OK {r}" in text, describe_all(jobs)
    want = FakeAccelerator(seed=0).model.state_dict()
    for d in (out, out + "-whole"):
        index = json.load(open(os.path.join(d, "model.safetensors.index.json")))
        loaded = {}
        for f in sorted(set(index["weight_map"].values())):
            loaded.update(load_file(os.path.join(d, f)))
        assert set(loaded) == set(want) - {"head.weight"} == set(index["weight_map"])
        for k, v in loaded.items():
            same(v, want[k], k)
        assert sorted(os.listdir(d)) == sorted(set(index["weight_map"].values()) | {"model.safetensors.index.json"})


def merge(*args):
    return subprocess.run([sys.executable, "-m", "accelerate_c", "merge-weights", *args], capture_output=True,
                          text=True, timeout=300, env=clean_env(), cwd=REPO)


def test_merge_weights_command(tmp_path):
    from safetensors.torch import load_file
    acc = FakeAccelerator()
    train(acc, 2)
    ck = str(tmp_path / "ck")
    gloo(tmp_path, "ddp2", 2, "default", "-", ck)
    r = merge(ck, str(tmp_path / "out"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert os.listdir(tmp_path / "out") == ["model.safetensors"]
    got = load_file(str(tmp_path / "out" / "model.safetensors"))
    want = reference().model.state_dict()
    assert set(got) == set(want) - {"head.weight"}
    for k, v in got.items():
        same(v, want[k], k)
    os.remove(os.path.join(ck, "model-rank00001-of-00002.safetensors"))
    r = merge(ck, str(tmp_path / "out2"))
    assert r.returncode != 0 and "model-rank00001-of-00002.safetensors" in r.stderr, r.stderr
    r = merge(str(tmp_path / "nope"), str(tmp_path / "out3"))
    assert r.returncode != 0 and "nope" in r.stderr, r.stderr
    ck1 = save_state(acc, str(tmp_path / "ck1"))
    r = merge(ck1, str(tmp_path / "out4"), "--remove_checkpoint_dir")
    assert r.returncode == 0 and not os.path.exists(ck1), r.stderr
    same(load_file(str(tmp_path / "out4" / "model.safetensors"))["lin.weight"], acc.model.lin.weight.detach())


def test_optimizer_over_tensors_of_no_prepared_model(tmp_path):
    acc = FakeAccelerator()
    w = torch.nn.Parameter(torch.randn(5))
    opt = torch.optim.SGD([w], lr=0.1, momentum=0.9)
    w.grad = torch.ones(5)
    opt.step()
    acc._optimizers.append(OptWrap(opt))
    ck = save_state(acc, str(tmp_path / "ck"))
    w2 = torch.nn.Parameter(torch.zeros(5))
    opt2 = torch.optim.SGD([w2], lr=0.5, momentum=0.9)
    new = FakeAccelerator(seed=3)
    new._optimizers.append(OptWrap(opt2))
    load_state(new, ck)
    same(opt2.state_dict(), opt.state_dict())


def test_load_into_existing_state_in_place(tmp_path):
    ref = reference()
    ck = save_state(ref, str(tmp_path / "ck"))
    new = FakeAccelerator(seed=5)
    train(new, 1)                                      # state exists: the checkpoint is read into it
    held = {k: st["exp_avg"].data_ptr() for k, st in new.opt.state_dict()["state"].items()}
    load_state(new, ck)
    same(new.opt.state_dict(), ref.opt.state_dict())
    same(dict(new.model.state_dict()), dict(ref.model.state_dict()))
    assert all(new.opt.state_dict()["state"][k]["exp_avg"].data_ptr() == ptr for k, ptr in held.items())


def test_a_rank_reads_only_its_ranges(tmp_path, monkeypatch):
    from accelerate_c.checkpointing import pieces
    ck = save_state(reference(), str(tmp_path / "ck"))
    real = pieces.TensorFile.read_into
    read = []

    def counting(self, key, first, out):
        if os.path.basename(self.path).startswith(("model", "optimizer")):   # the piece files (not RNG, loaders)
            read.append((key, out.numel() * out.element_size()))
        return real(self, key, first, out)

    monkeypatch.setattr(pieces.TensorFile, "read_into", counting)
    for rank in range(3):
        read.clear()
        acc = sharded(FakeAccelerator(seed=9), rank, 3)
        load_state(acc, ck)
        tensors = sum(n for k, n in read if not k.startswith("~"))
        want = sum(s.numel * s.data.element_size() for s in acc.strategy.model_slices(acc.model)
                   if s.name != "head.weight")                          # tied: read once, as emb.weight
        want += sum(2 * 4 * slot.numel for slot in acc.strategy.optimizer_layout(acc.opt, acc.model))
        assert tensors == want, (rank, tensors, want)
