# tests/scripts/load_agree.py: a 2-process load_state that one rank cannot complete, under whatever strategy the
# launcher gives. A small model with buffers (BatchNorm) and a frozen layer trains one step and is saved; then, for
# each case, rank 0 breaks the checkpoint (after a barrier, so both ranks see the same files), both ranks train a
# step away from it, try load_state, catch the error, and record it with a digest of everything a load changes
# (parameters read as user code reads them, optimizer state, scheduler, RNG, step). Cases: a piece file of rank 1
# deleted (every rank can see it), rank 1's RNG state made invalid (only rank 1 reads it). Last, the intact
# checkpoint loads (what differs from the state at save is recorded). Writes <out>/agree<rank>.json.
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil

import torch

from accelerate_c import Accelerator


def digest(acc: Accelerator, model: torch.nn.Module, opt: torch.optim.Optimizer, sched) -> dict:
    """A hash per part of the state (parameters and buffers as user code reads them: gathered under ZeRO-3)."""
    def h(*parts: bytes) -> str:
        return hashlib.sha256(b"".join(parts)).hexdigest()[:16]
    out = {k: h(v.detach().float().cpu().numpy().tobytes()) for k, v in acc.unwrap_model(model).state_dict().items()}
    for i, st in opt.state_dict()["state"].items():
        if all(v.numel() == 0 for k, v in st.items() if k != "step"):
            continue   # a rank's empty shard of a parameter: state of 0 elements, the same as none
        out[f"opt{i}"] = h(*(v.detach().float().cpu().numpy().tobytes() if isinstance(v, torch.Tensor)
                             else repr(v).encode() for v in st.values()))
    out.update(sched=h(repr(sched.state_dict()).encode()), rng=h(torch.get_rng_state().numpy().tobytes()),
               step=str(acc.step))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    acc = Accelerator()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(),
                                torch.nn.Linear(16, 16), torch.nn.Linear(16, 1))
    model[3].requires_grad_(False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(64, 8)), batch_size=4)
    model, opt, sched, data = acc.prepare(model, opt, sched, data)
    batches = iter(data)

    def train_step() -> None:
        (x,) = next(batches)
        loss = model(x).square().mean()
        acc.backward(loss)
        opt.step()
        sched.step()
        opt.zero_grad()

    train_step()
    ck = os.path.join(args.out, "ck")
    acc.save_state(ck)
    saved = digest(acc, model, opt, sched)
    spare = os.path.join(args.out, "spare")
    if acc.is_main_process:
        shutil.copytree(ck, spare)
    acc.wait_for_everyone()
    record = {"cases": {}}
    breakers = {"piece_deleted": lambda: os.remove(os.path.join(ck, "model-rank00001-of-00002.safetensors")),
                "rng_of_rank1": lambda: _break_rng(ck, 1)}
    for case, breaker in breakers.items():
        if acc.is_main_process:
            shutil.rmtree(ck)
            shutil.copytree(spare, ck)
            breaker()
        acc.wait_for_everyone()
        train_step()
        before = digest(acc, model, opt, sched)
        try:
            acc.load_state(ck)
            error = None
        except Exception as e:   # what a script that catches the error and starts fresh sees
            error = f"{type(e).__name__}: {e}"
        record["cases"][case] = {"error": error, "unchanged": digest(acc, model, opt, sched) == before}
        acc.wait_for_everyone()
    # a save given a different directory on each rank (HF's test scripts do this with their own temp dirs): every
    # rank raises, nothing is left in either directory or beside it
    mine = os.path.join(args.out, f"per_rank{acc.process_index}", "ck")
    try:
        acc.save_state(mine)
        error = None
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
    acc.wait_for_everyone()
    record["per_rank_save"] = {"error": error, "left": sorted(
        os.path.relpath(os.path.join(d, f), args.out) for r in range(acc.num_processes)
        for d, _, fs in os.walk(os.path.join(args.out, f"per_rank{r}")) for f in [*fs, *_])}
    if acc.is_main_process:
        shutil.rmtree(ck)
        shutil.copytree(spare, ck)
    acc.wait_for_everyone()
    acc.load_state(ck)
    now = digest(acc, model, opt, sched)
    record["restored"] = now == saved
    record["differs"] = sorted(k for k in set(saved) | set(now) if now.get(k) != saved.get(k))
    with open(os.path.join(args.out, f"agree{acc.process_index}.json"), "w") as f:
        json.dump(record, f)


def _break_rng(ck: str, rank: int) -> None:
    """Rank `rank`'s torch RNG state replaced by 3 bytes (its listed size updated: the content is what is bad)."""
    path = os.path.join(ck, f"random_states_{rank}.json")
    doc = json.load(open(path))
    doc["data"]["python"] = {"__t__": "tuple", "v": [3, [1, 2], None]}
    text = json.dumps(doc)
    open(path, "w").write(text)
    meta_path = os.path.join(ck, "checkpoint.json")
    meta = json.load(open(meta_path))
    meta["files"][f"random_states_{rank}.json"] = len(text.encode())
    open(meta_path, "w").write(json.dumps(meta))


if __name__ == "__main__":
    main()
