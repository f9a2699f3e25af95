# tests/scripts/launcher_train.py: trains a small model from a plain function through accelerate_c's
# notebook_launcher / debug_launcher (or in this process), each rank writing what it saw to OUT/<tag>_r<rank>.json;
# "fail" modes make rank 1 raise while rank 0 is busy, and record what the caller caught.
# Usage: launcher_train.py MODE OUT [PORT]. Not for: assertions (tests/test_launchers.py compares the files).
import json
import os
import sys
import tempfile
import time

import torch

from accelerate_c import Accelerator, debug_launcher, notebook_launcher
from accelerate_c.utils import save, tqdm


def train(out: str, tag: str, batch_size: int) -> None:
    acc = Accelerator()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(32, 4, generator=g), torch.randn(32, 1, generator=g)
    dl = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=batch_size)
    pmodel, opt, dl = acc.prepare(model, opt, dl)
    losses = []
    for xb, yb in tqdm(dl):
        loss = torch.nn.functional.mse_loss(pmodel(xb), yb)
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(acc.reduce(loss.detach(), "mean").item())
    rank = acc.process_index
    save({"w": torch.ones(2)}, os.path.join(out, f"{tag}_save_r{rank}.pt"))  # main process only
    record = {
        "rank": rank, "world": acc.num_processes, "local": acc.local_process_index, "losses": losses,
        "params": [p.detach().reshape(-1).tolist() for p in acc.unwrap_model(pmodel).parameters()],
        "unwrapped_is_model": acc.unwrap_model(pmodel) is model, "wrapped": pmodel is not model,
        "tqdm_disabled": bool(tqdm(range(1)).disable), "mixed_precision": acc.mixed_precision,
        "distributed_type": str(acc.distributed_type.value),
    }
    with open(os.path.join(out, f"{tag}_r{rank}.json"), "w") as fh:
        json.dump(record, fh)
    acc.end_training()


def probe(out: str, tag: str) -> None:
    acc = Accelerator()
    with open(os.path.join(out, f"{tag}_r{acc.process_index}.json"), "w") as fh:
        json.dump({"mixed_precision": acc.mixed_precision, "world": acc.num_processes}, fh)
    acc.end_training()


def fail(out: str) -> None:
    acc = Accelerator()
    with open(os.path.join(out, f"tempdir_r{acc.process_index}"), "w") as fh:  # the caller's, not the launch folder
        fh.write(tempfile.gettempdir())
    with open(os.path.join(out, f"pid_r{acc.process_index}.tmp"), "w") as fh:
        fh.write(str(os.getpid()))
    os.replace(os.path.join(out, f"pid_r{acc.process_index}.tmp"), os.path.join(out, f"pid_r{acc.process_index}"))
    if acc.process_index == 1:
        for _ in range(600):  # rank 0 has recorded its pid (and goes on to wait for us)
            if os.path.exists(os.path.join(out, "pid_r0")):
                break
            time.sleep(0.1)
        raise ValueError("boom on rank 1")
    time.sleep(600)  # busy for longer than the test's timeout: only the launcher stopping this rank ends it
    acc.wait_for_everyone()


def main() -> None:
    mode, out = sys.argv[1], sys.argv[2]
    port = sys.argv[3] if len(sys.argv) > 3 else "29500"
    if mode == "single":
        notebook_launcher(train, args=(out, "single", 8), num_processes=1)
    elif mode == "notebook":
        notebook_launcher(train, args=(out, "notebook", 4), num_processes=2, use_port=port)
        # a second launch from the same caller (a notebook re-running a cell), with mixed precision
        notebook_launcher(probe, args=(out, "bf16"), num_processes=2, use_port=port, mixed_precision="bf16")
    elif mode == "debug":
        debug_launcher(train, args=(out, "debug", 4), num_processes=2)
    elif mode in ("fail", "debug_fail"):
        try:
            if mode == "fail":
                notebook_launcher(fail, args=(out,), num_processes=2, use_port=port)
            else:
                debug_launcher(fail, args=(out,), num_processes=2)
        except Exception as e:  # noqa: BLE001 - the test inspects what the caller got
            with open(os.path.join(out, "caught.json"), "w") as fh:
                json.dump({"type": type(e).__name__, "message": str(e)}, fh)
    else:
        sys.exit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main()
