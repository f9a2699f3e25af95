# tests/test_lifetimes.py: an Accelerator in a long-lived process, as notebooks and sweeps use it. On 2 CPU processes
# (tests/scripts/lifetimes.py): 40 prepares of models with buffers and a frozen parameter, under DDP and the FSDP face,
# leave nothing alive once dropped (torch keeps parameter hooks out of garbage collection: ours are weak, so the
# gradient buffers and their shared-memory regions go; before, the 33rd prepare failed), and pickling the Accelerator
# works as HF's does (a live copy in the process; refused with what to do instead once a distributed model is
# prepared). In a fresh process that pickle fails with an error naming the live object; a one-process Accelerator
# with its model, optimizer and loader pickles into a fresh process and trains there.
# Not for: checkpoints (test_checkpointing.py) or HF's own pickling check (test_hf_scripts.py runs it).
import os
import pickle
import subprocess
import sys

import torch

from conftest import clean_env, run_script

_LOAD = """
import pickle, sys, torch
from accelerate_c.state import PartialState
PartialState(cpu=True)._shared_state["made_here"] = True  # a state made before unpickling: its values win
acc, model, opt, loader = pickle.loads(open(sys.argv[1], "rb").read())
assert acc._models[0] is model and acc.gradient_state._owner() is acc and acc.num_processes == 1
assert acc.state.__dict__.get("made_here") and acc.state.mixed_precision == "no"
for batch in loader:
    with acc.accumulate(model):
        acc.backward(model(batch).sum())
        opt.step()
        opt.zero_grad()
print("TRAINED", acc.step, float(model[0].weight.sum()))
"""


def test_many_prepares_and_pickling_on_two_processes(tmp_path):
    out = tmp_path
    run_script("lifetimes.py", ["--out", str(out)], nproc=2, launcher="accelerate_c")
    assert sorted(os.listdir(out)) == ["accelerator0.pkl", "accelerator1.pkl", "ok0.txt", "ok1.txt"]
    r = subprocess.run([sys.executable, "-c", "import pickle, sys; pickle.loads(open(sys.argv[1], 'rb').read())",
                        str(out / "accelerator0.pkl")], capture_output=True, text=True, timeout=120, env=clean_env())
    assert r.returncode != 0 and "can be unpickled only in that process" in r.stderr, r.stderr[-2000:]


def test_one_process_accelerator_pickles_into_a_fresh_process(tmp_path, clean_state):
    from accelerate_c import Accelerator

    acc = Accelerator(gradient_accumulation_steps=2, cpu=True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(2, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 1))
    model, opt, loader = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                                     torch.utils.data.DataLoader(torch.randn(16, 2), batch_size=4))
    for batch in loader:
        with acc.accumulate(model):
            acc.backward(model(batch).sum())
            opt.step()
            opt.zero_grad()
    copy = pickle.loads(pickle.dumps(acc))
    assert copy.state.__dict__ is acc.state.__dict__ and copy.gradient_state._owner() is acc  # the live owner stays
    path = tmp_path / "acc.pkl"
    path.write_bytes(pickle.dumps((acc, model, opt, loader)))
    r = subprocess.run([sys.executable, "-c", _LOAD, str(path)], capture_output=True, text=True, timeout=120,
                       env=clean_env())
    assert r.returncode == 0 and "TRAINED" in r.stdout, r.stdout[-2000:] + r.stderr[-3000:]
    before = float(model[0].weight.detach().sum())
    assert float(r.stdout.split()[-1]) != before  # it trained there
