# The script `python -m accelerate_c test` launches on 2 processes: trains a tiny regression model with
# accelerate_c.Accelerator (prepare / backward / gather, the HF Accelerate API) and checks that the final
# weights equal a plain single-process loop over the same global batches. Exits non-zero on mismatch.
# Not for: import by library code; it is run as a script by the launcher.
import sys

import torch

from accelerate_c import Accelerator

STEPS, PER_RANK_BATCH, LR = 6, 8, 0.1


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def main() -> int:
    accelerator = Accelerator()
    n = accelerator.num_processes
    global_batch = PER_RANK_BATCH * n
    g = torch.Generator().manual_seed(1)
    x = torch.randn(STEPS * global_batch, 4, generator=g)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]) + 0.1 * torch.randn(len(x), 1, generator=g)
    idx = torch.arange(len(x), dtype=torch.float32).unsqueeze(1)
    data = torch.utils.data.TensorDataset(x, y, idx)
    loader = torch.utils.data.DataLoader(data, batch_size=PER_RANK_BATCH, shuffle=False)

    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    seen = []
    for xb, yb, ib in loader:
        loss = torch.nn.functional.mse_loss(model(xb), yb)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        seen.append(accelerator.gather(ib.to(accelerator.device)).cpu())

    # Reference: one process, global batches of PER_RANK_BATCH * n consecutive samples.
    ref = make_model()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
    for s in range(STEPS):
        sl = slice(s * global_batch, (s + 1) * global_batch)
        torch.nn.functional.mse_loss(ref(x[sl]), y[sl]).backward()
        ref_opt.step()
        ref_opt.zero_grad()

    ours = accelerator.unwrap_model(model).state_dict()
    errors = []
    for name, want in ref.state_dict().items():
        got = ours[name].detach().cpu()
        if not torch.allclose(got, want, rtol=1e-5, atol=1e-6):
            errors.append(f"{name}: max abs diff {(got - want).abs().max().item():.3e}")
    gathered = torch.cat(seen).flatten().sort().values
    if len(seen) != STEPS or not torch.equal(gathered, torch.arange(len(x), dtype=torch.float32)):
        errors.append(f"gather saw {gathered.numel()} samples over {len(seen)} steps, expected {len(x)} / {STEPS}")
    accelerator.wait_for_everyone()
    if errors:
        print(f"[rank {accelerator.process_index}] self-check FAILED: " + "; ".join(errors), flush=True)
        return 1
    if accelerator.is_main_process:
        print(f"self-check passed: {n} processes match the single-process run ({STEPS} steps)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
