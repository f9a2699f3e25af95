# tests/scripts/resume_train.py: exact-resume check. Trains a small model with dropout, a shuffled loader,
# AdamW and a scheduler for --total steps; with --save_at k1,k2,.. it saves state after each of those steps into
# <ckpt>/step<k> and trains on; with --resume it loads the state in --ckpt and continues, either HF's way (--mode hf:
# load_state, then skip_first_batches for the rest of the epoch) or automatically (--mode stateful:
# DataLoaderConfiguration(use_stateful_dataloader=True)). Writes final weights to --out on the main process.
# Not for: anything but tests/test_resume.py.
import argparse
import os

import torch

from accelerate_c import Accelerator, DataLoaderConfiguration
from accelerate_c.utils import set_seed


class Counter:
    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, sd: dict) -> None:
        self.step = sd["step"]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--ckpt", required=True)
    p.add_argument("--total", type=int, default=14)
    p.add_argument("--save_at", default="", help="steps after which to save state (comma-separated)")
    p.add_argument("--resume", action="store_true")
    p.add_argument("--mode", choices=["hf", "stateful"], default="hf")
    args = p.parse_args()
    accelerator = Accelerator(dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=args.mode == "stateful"))
    set_seed(0)
    x = torch.randn(40, 6)
    y = torch.randn(40, 1)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4 // accelerator.num_processes,
                                         shuffle=True)
    model = torch.nn.Sequential(torch.nn.Linear(6, 32), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(32, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.05 * s))
    model, opt, loader, sched = accelerator.prepare(model, opt, loader, sched)
    save_at = {int(k) for k in args.save_at.split(",") if k}
    counter = Counter()
    accelerator.register_for_checkpointing(counter)
    if args.resume:
        accelerator.load_state(args.ckpt)
    per_epoch = len(loader)
    start_epoch = counter.step // per_epoch
    epoch = start_epoch
    while counter.step < args.total:
        active = loader
        if args.resume and args.mode == "hf" and epoch == start_epoch:
            active = accelerator.skip_first_batches(loader, counter.step % per_epoch)
        for xb, yb in active:
            loss = torch.nn.functional.mse_loss(model(xb), yb)
            accelerator.backward(loss)
            opt.step()
            sched.step()
            opt.zero_grad()
            counter.step += 1
            if counter.step in save_at:
                accelerator.save_state(os.path.join(args.ckpt, f"step{counter.step}"))
            if counter.step >= args.total:
                break
        epoch += 1
    if accelerator.is_main_process:
        from safetensors.torch import save_file
        os.makedirs(args.out, exist_ok=True)
        sd = accelerator.unwrap_model(model).state_dict()
        save_file({k: v.contiguous() for k, v in sd.items()}, os.path.join(args.out, "w.safetensors"))
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    main()
