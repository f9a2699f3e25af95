# accelerate_c/strategies/ddp_join.py: uneven inputs for data parallelism (Accelerator.join_uneven_inputs), torch
# DDP's Join protocol on our gradient sync, on CPU processes too (HF's only runs on GPUs). Inside the context, each
# forward of a prepared model first all-reduces a vector [one-hot "I am active" per rank, "this forward syncs"];
# a rank whose loop has ended waits in `shadow()` at the context's exit, all-reducing zeros and mirroring what the
# active ranks do: the buffer broadcast (from the highest active rank, rank 0 may be done) and, when they sync, the
# gradient all-reduces with zero gradients (so averages divide by the initial world size, as torch's default).
# When every rank is done, parameters and buffers are broadcast from the last rank to finish (the one holding the
# most steps), as torch's Join post-hook does. The host-split optimizer step is suspended for the context (its
# barriers would wait for ranks that no longer step); afterwards every rank steps whole with its own state, as in
# torch DDP after a join.
# Not for: the gradient sync itself (ddp.py, ddp_bucketed.py) or data loading (even_batches is the Accelerator's).
from __future__ import annotations

from typing import Any

import torch


class JoinProtocol:
    """One join context over `models` (prepared DataParallelModules, in joinables order) of `strategy`."""

    def __init__(self, strategy: Any, models: list) -> None:
        self.strategy = strategy
        self.models = models
        self.world = strategy.state.num_processes
        self.rank = strategy.state.process_index

    def _exchange(self, active: bool, sync: bool) -> torch.Tensor:
        v = torch.zeros(self.world + 1, dtype=torch.float64)
        v[self.rank] = 1.0 if active else 0.0
        v[self.world] = 1.0 if sync else 0.0
        self.strategy.all_reduce_sum(v)
        return v

    def _active_ranks(self, v: torch.Tensor) -> list[int]:
        return [r for r in range(self.world) if v[r] > 0]

    def notify(self, model: Any, sync: bool) -> int:
        """An active rank's forward of `model`: tell the others; returns the rank buffers come from."""
        return max(self._active_ranks(self._exchange(True, sync)))

    def shadow(self) -> bool:
        """A rank out of inputs: mirror the active ranks' collectives until every rank is out. True when no rank was
        still active at this rank's first check (it is one of the last to finish)."""
        last = True
        while True:
            for k, model in enumerate(self.models):
                v = self._exchange(False, False)
                active = self._active_ranks(v)
                if not active:
                    if k == 0:
                        return last
                    raise RuntimeError("join_uneven_inputs: the ranks still training did not run a forward of every "
                                       f"joined model in each iteration (model {k} of {len(self.models)} got none)")
                last = False
                sync = bool(v[self.world] > 0)
                model._shadow_forward(max(active), sync)

    def finish(self, last: bool) -> None:
        """Every rank is out: all take the parameters and buffers of the highest rank among the last to finish."""
        v = self._exchange(last, False)
        src = max(self._active_ranks(v))
        for model in self.models:
            self.strategy.broadcast(list(model.module.parameters()) + list(model.module.buffers()), src=src)
