# tests/scripts/lifetimes.py: what a long-lived process (a notebook, a sweep) does to an Accelerator, on N CPU
# processes under our launcher: (1) prepares and trains model after model (BatchNorm buffers, a frozen parameter),
# each time with a fresh Accelerator, under DDP and then under the FSDP face; every prepared model's gradient
# machinery must be collectable once the user drops it, and the shared-memory regions behind it reused (before,
# the 33rd DDP prepare failed: "too many shm regions"); (2) pickles the Accelerator of the run (a model, an
# optimizer and a dataloader prepared) and unpickles it in this process: the copy shares the live process state
# and keeps the per-step counters; (3) writes the pickle to --out for the test to unpickle in a fresh process,
# which must fail with an error that names what cannot be restored.
# Writes --out/ok<RANK>.txt when every check passed.
from __future__ import annotations

import argparse
import gc
import os
import pickle
import weakref

import torch

from accelerate_c import Accelerator, FullyShardedDataParallelPlugin
from accelerate_c.state import AcceleratorState, GradientState

ROUNDS = 40  # more than the 32 regions a group can hold at once


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1, self.bn, self.l2 = torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 1)
        self.frozen = torch.nn.Linear(16, 16)
        self.frozen.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(self.frozen(torch.relu(self.bn(self.l1(x)))))


def _one_round(accelerator: Accelerator) -> list:
    """Prepares and trains one model; returns weak references to what its gradient machinery is made of."""
    model = Net()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model, opt = accelerator.prepare(model, opt)
    for _ in range(2):
        accelerator.backward(model(torch.randn(4, 8)).pow(2).mean())
        opt.step()
        opt.zero_grad()
    engines = [getattr(model, "_grad_sync", None), *getattr(accelerator.strategy, "engines", [])]
    return [weakref.ref(model), *(weakref.ref(e) for e in engines if e is not None)]


def _rounds(make: callable, rounds: int) -> None:
    refs = []
    for _ in range(rounds):
        refs += _one_round(make())
    gc.collect()
    alive = [r() for r in refs if r() is not None]
    assert not alive, f"still alive after the user dropped them: {sorted({type(o).__name__ for o in alive})}"


def _pickled(out: str) -> None:
    accelerator = Accelerator(gradient_accumulation_steps=2)
    loader = accelerator.prepare(torch.utils.data.DataLoader(torch.arange(32.0).view(16, 2), batch_size=2))
    accelerator._do_sync()  # one micro-step of accumulation, as accumulate() counts it
    blob = pickle.dumps(accelerator)
    copy = pickle.loads(blob)
    assert copy is not accelerator and copy.state.__dict__ is accelerator.state.__dict__
    assert copy.gradient_state.__dict__ is accelerator.gradient_state.__dict__
    assert (copy.step, copy.num_processes, copy.process_index) == (accelerator.step, accelerator.num_processes,
                                                                   accelerator.process_index) and copy.step == 1
    assert copy.gradient_accumulation_steps == 2 and len(copy._dataloaders) == 1
    assert [b.tolist() for b in copy._dataloaders[0]] == [b.tolist() for b in loader]
    with open(os.path.join(out, f"accelerator{accelerator.process_index}.pkl"), "wb") as f:
        f.write(blob)
    model = accelerator.prepare(Net())  # a prepared N-process model: refused, with what to do instead
    for obj in (accelerator, model):
        try:
            pickle.dumps(obj)
        except TypeError as e:
            assert "unwrap_model" in str(e), e
        else:
            raise AssertionError(f"pickling a prepared {type(obj).__name__} of a distributed run did not fail")
    assert pickle.loads(pickle.dumps(accelerator.unwrap_model(model))) is not None


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    args = p.parse_args()
    _rounds(Accelerator, ROUNDS)
    _pickled(args.out)
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    _rounds(lambda: Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(sharding_strategy="FULL_SHARD")), 4)
    rank = int(os.environ.get("RANK", "0"))
    with open(os.path.join(args.out, f"ok{rank}.txt"), "w") as f:
        f.write("ok\n")


if __name__ == "__main__":
    main()
