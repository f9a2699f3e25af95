# tests/test_fp8_checkpoint.py: fp8 delayed scaling across save_state / load_state (checkpointing/scaling.py).
#  - Exact resume: an fp8 delayed-scaling run of 6 steps vs the same run saved at step 3 and resumed by a fresh
#    Accelerator and model (empty amax histories, as in a new process): losses, weights and histories bitwise
#    equal; model.safetensors holds the plain state dict only (no fp8 state in it).
#  - A checkpoint without fp8 state (a run without fp8; older checkpoints lack the same key): loads into an fp8
#    run, which warns and starts its histories empty; an fp8 checkpoint loads into a run without fp8.
#  - Another world size: a checkpoint saved by 2 ranks (two threads, fake accelerators, different histories per
#    rank) loaded as rank r of 1 and 3 ranks gives saved rank r % 2's histories; a shorter amax_history_len keeps
#    the newest entries; a model whose fp8 layers differ, or a malformed history, is a CheckpointError naming the
#    file and the layer (strict), and leaves the histories untouched.
# The 2-process case (sharded engine, delayed scaling) is test_sharded_fp8.py's --resume_check.
# Not for: FP8Linear's numerics (test_precision.py) or the checkpoint format (test_checkpointing.py).
import json
import logging
import os
import threading

import pytest
import torch
from safetensors.torch import load_file

from accelerate_c import Accelerator, FP8RecipeKwargs
from accelerate_c.checkpointing import CheckpointError, load_state, save_state
from accelerate_c.precision.fp8 import FP8Config, FP8Linear, convert_to_fp8, scaling_state
from bitwise import same
from conftest import reset_state, rewrite_listed
from test_checkpointing import FakeAccelerator


@pytest.fixture(autouse=True)
def fresh_state():
    reset_state("accelerate_c")
    yield
    reset_state("accelerate_c")


def _setup(mp: str = "fp8"):
    reset_state("accelerate_c")
    handler = FP8RecipeKwargs(fp8_format="HYBRID", use_delayed_scaling=True, amax_history_len=3,
                              amax_compute_algo="max")
    acc = Accelerator(mixed_precision=mp, kwargs_handlers=[handler] if mp == "fp8" else None)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = acc.prepare(model, opt)
    return acc, model, opt


def _steps(acc, model, opt, start: int, stop: int) -> list:
    losses = []
    for i in range(start, stop):
        g = torch.Generator().manual_seed(100 + i)
        x = torch.randn(8, 16, generator=g) * (1 + i % 3)  # changing scales: delayed != current scaling
        y = torch.randn(8, 4, generator=g)
        loss = torch.nn.functional.mse_loss(model(x), y)
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_fp8_delayed_scaling_resumes_bitwise(tmp_path):
    ck = str(tmp_path / "ck")
    acc, model, opt = _setup()
    _steps(acc, model, opt, 0, 3)
    acc.save_state(ck)
    ref_losses = _steps(acc, model, opt, 3, 6)
    ref_weights = {k: v.clone() for k, v in model.state_dict().items()}
    ref_hist = scaling_state(model)
    assert all(len(h) == 3 for layer in ref_hist.values() for h in layer.values()), ref_hist

    acc2, model2, opt2 = _setup()  # a fresh run: new FP8Linear layers, empty histories
    assert all(h == [] for layer in scaling_state(model2).values() for h in layer.values())
    acc2.load_state(ck)
    assert _steps(acc2, model2, opt2, 3, 6) == ref_losses
    same(dict(model2.state_dict()), ref_weights)
    assert scaling_state(model2) == ref_hist
    # the scaling state is a per-rank state file; the model file is the plain state dict
    assert os.path.isfile(os.path.join(ck, "fp8_states_0.json"))
    assert set(load_file(os.path.join(ck, "model.safetensors"))) == set(model.state_dict())
    assert json.load(open(os.path.join(ck, "checkpoint.json")))["fp8_states"] is True


def test_checkpoint_without_fp8_state(tmp_path, caplog):
    plain = str(tmp_path / "plain")
    acc, model, opt = _setup("no")
    _steps(acc, model, opt, 0, 2)
    acc.save_state(plain)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    assert not any(n.startswith("fp8_states") for n in os.listdir(plain))

    acc8, model8, opt8 = _setup("fp8")
    _steps(acc8, model8, opt8, 0, 2)  # histories filled: loading must not keep them
    with caplog.at_level(logging.WARNING, logger="accelerate_c.checkpointing.scaling"):
        acc8.load_state(plain)
    assert "holds no fp8 scaling state" in caplog.text
    assert all(h == [] for layer in scaling_state(model8).values() for h in layer.values())
    same(dict(model8.state_dict()), weights)
    fp8_ck = str(tmp_path / "fp8")
    _steps(acc8, model8, opt8, 2, 3)
    acc8.save_state(fp8_ck)
    fp8_weights = {k: v.clone() for k, v in model8.state_dict().items()}

    acc, model, opt = _setup("no")  # an fp8 checkpoint into a run without fp8: its scaling state is unused
    acc.load_state(fp8_ck)
    same(dict(model.state_dict()), fp8_weights)


def _fp8_fake(rank: int, world: int, barrier=None, history_len: int = 4, exclude: str = ""):
    acc = FakeAccelerator(seed=0, rank=rank, world=world, barrier=barrier)
    cfg = FP8Config(use_delayed_scaling=True, amax_history_len=history_len,
                    module_filter_func=(lambda m, name: name != exclude) if exclude else None)
    convert_to_fp8(acc.model, cfg)
    return acc


def test_fp8_state_under_another_world_size(tmp_path):
    ck = str(tmp_path / "ck2")
    barrier = threading.Barrier(2, timeout=60)
    ranks = [_fp8_fake(r, 2, barrier.wait) for r in range(2)]
    saved = []
    for r, acc in enumerate(ranks):  # rank r's own histories (different inputs per rank)
        for i, m in enumerate(m for m in acc.model.modules() if isinstance(m, FP8Linear)):
            for j, st in enumerate((m.x_state, m.w_state, m.g_state)):
                st.history = [float(100 * r + 10 * i + j + k) + 0.25 for k in range(4)]
        saved.append(scaling_state(acc.model))
    assert saved[0] != saved[1] and set(saved[0]) == {"lin", "head"}
    errors = []

    def save(acc):
        try:
            save_state(acc, ck)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
            barrier.abort()
    threads = [threading.Thread(target=save, args=(a,)) for a in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and not any(t.is_alive() for t in threads), errors
    assert {"fp8_states_0.json", "fp8_states_1.json"} <= set(os.listdir(ck))

    for world in (1, 3):
        for rank in range(world):
            acc = _fp8_fake(rank, world)
            load_state(acc, ck)
            assert scaling_state(acc.model) == saved[rank % 2], (world, rank)
    short = _fp8_fake(1, 2, history_len=2)  # a shorter history keeps the newest amaxes
    load_state(short, ck)
    assert scaling_state(short.model) == {n: {k: h[-2:] for k, h in layer.items()} for n, layer in saved[1].items()}
    with pytest.raises(CheckpointError, match=r"fp8_states_0.*missing \[\].*unexpected \['lin'\]"):
        load_state(_fp8_fake(0, 1, exclude="lin"), ck)
    path = os.path.join(ck, "fp8_states_1.json")  # a bad history: an error naming the file, layer and key
    doc = json.load(open(path))
    doc["data"][0]["head"]["g"] = ["1.5"]
    rewrite_listed(ck, "fp8_states_1.json", json.dumps(doc))  # its listed size too: the content is what is bad
    bad = _fp8_fake(1, 2)
    with pytest.raises(CheckpointError, match=r"fp8_states_1.*'head': 'g' must be a list of floats"):
        load_state(bad, ck)
    assert all(h == [] for layer in scaling_state(bad.model).values() for h in layer.values())  # nothing half-set
