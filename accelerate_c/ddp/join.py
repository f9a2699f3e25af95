# accelerate_c/ddp/join.py: uneven inputs for data parallelism (Accelerator.join_uneven_inputs), torch
# DDP's Join protocol on our gradient sync, on CPU processes too (HF's only runs on GPUs). Inside the context, each
# forward of a prepared model first all-reduces a vector [one-hot "I am active" per rank, SyncAgreement's fields];
# a rank whose loop has ended waits in `shadow()` at the context's exit, all-reducing zeros and mirroring what the
# active ranks do: the buffer broadcast (from the highest active rank, rank 0 may be done) and, when they sync, the
# gradient all-reduces with zero gradients (so averages divide by the initial world size, as torch's default;
# micro-batches a rank accumulated unsynced before it ran out are dropped, as torch's joined rank does), except
# once after its own sync was deferred (SyncAgreement): then its last micro-batches count in the others' next step.
# When every rank is done, parameters and buffers are broadcast from the last rank to finish (the one holding the
# most steps), as torch's Join post-hook does. The host-split optimizer step is suspended for the context (its
# barriers would wait for ranks that no longer step); afterwards every rank steps whole with its own state, as in
# torch DDP after a join.
# SyncAgreement (here, also used by sharding/join.py): whether a forward of the ranks still training syncs.
# Not for: the gradient sync itself (ddp.py, ddp_bucketed.py) or data loading (even_batches is the Accelerator's).
from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

NFIELDS = 3  # SyncAgreement's fields in an announcement


class SyncAgreement:
    """Whether a forward of the ranks still training syncs its backward: only when every one of them wants to. HF's
    `accumulate` syncs at each rank's own last batch, so with uneven inputs a rank finishing mid-accumulation wants
    to sync while the others accumulate; torch DDP's Join then issues the gradient all-reduce on that rank alone (a
    mismatched collective). Here that rank runs the iteration as an accumulation one instead: its sync is switched
    off for the backward and its clip, optimizer step (reported skipped, so the scheduler holds) and zero_grad of
    the iteration do nothing; its gradients join the next step the others take (as a training rank, or mirrored
    from `shadow()` once out of inputs). The one owner of this rule for every join (stage 0 here, stages 1-3 in
    sharding/join.py); each announces `fields(...)` in its own vector, reduced by sum or max over the ranks."""

    def __init__(self) -> None:
        self.deferred: Optional[str] = None  # "backward": a sync turned into accumulation; "stepped": step skipped
        self._switched: list[tuple[Any, bool]] = []  # (sync switch, its value before the deferral)

    def wish(self, switch: Any) -> bool:
        """A training rank's forward: a deferral still open ends here (a new iteration); True when it wants its
        backward to sync (grad mode, outside no_sync). `switch`: the model's sync (`.enabled`)."""
        self.end()
        return torch.is_grad_enabled() and bool(switch.enabled)

    @staticmethod
    def fields(sync: bool) -> list[float]:
        """This rank's announcement of a forward: [grad enabled, grad disabled, grad enabled without sync]."""
        grad = torch.is_grad_enabled()
        return [float(grad), float(not grad), float(grad and not sync)]

    @staticmethod
    def agreed(fields: Sequence[Any]) -> bool:
        """The forward syncs: from `fields` reduced (sum or max) over the training ranks."""
        grad, nograd, nosync = (float(x) > 0 for x in fields)
        if grad and nograd:
            raise RuntimeError("join_uneven_inputs: the ranks still training ran a forward of the model with "
                               "gradients enabled on some ranks and disabled on others")
        return grad and not nosync

    def settle(self, switch: Any, sync: bool, agreed: bool) -> None:
        """This rank wanted `sync`, the training ranks agreed on `agreed`: a lone sync waits for the others'."""
        if sync and not agreed:
            self.deferred = "backward"
            self._switched.append((switch, bool(switch.enabled)))
            switch.enabled = False

    def end(self) -> None:
        """The deferral is over (a step skipped, a new forward, out of inputs): the syncs as they were."""
        for switch, prev in reversed(self._switched):
            switch.enabled = prev
        self._switched = []
        self.deferred = None

    def skip_clip(self) -> bool:
        return self.deferred is not None

    def skip_step(self) -> bool:
        if self.deferred is None:
            return False
        self.end()
        self.deferred = "stepped"
        return True

    def skip_zero_grad(self) -> bool:
        return self.deferred is not None


class JoinProtocol:
    """One join context over `models` (prepared DataParallelModules, in joinables order) of `strategy`."""

    def __init__(self, strategy: Any, models: list) -> None:
        self.strategy = strategy
        self.models = models
        self.world = strategy.dp.size  # the data-parallel ranks join (the others hold other model slices)
        self.rank = strategy.dp.rank
        self.agreement = SyncAgreement()

    def _exchange(self, fields: Optional[list[float]]) -> torch.Tensor:
        """Active ranks: their one-hot and fields; ranks out of inputs: zeros. Summed over every rank."""
        v = torch.zeros(self.world + NFIELDS, dtype=torch.float64)
        if fields is not None:
            v[self.rank] = 1.0
            v[self.world:] = torch.tensor(fields, dtype=torch.float64)
        device = self.strategy.state.device
        if device.type == "cpu":
            self.strategy.all_reduce_sum(v)
            return v
        on = v.to(device)  # the buckets' group is the device's (NCCL reduces no CPU tensor); read back on the host
        self.strategy.all_reduce_sum(on)
        return on.cpu()

    def _active_ranks(self, v: torch.Tensor) -> list[int]:
        return [r for r in range(self.world) if v[r] > 0]

    def notify(self, model: Any) -> int:
        """An active rank's forward of `model`: tell the others, agree on whether it syncs (switching this rank's
        sync off when it alone wanted it); returns the rank buffers come from."""
        sync = self.agreement.wish(model._grad_sync)
        v = self._exchange(SyncAgreement.fields(sync))
        self.agreement.settle(model._grad_sync, sync, SyncAgreement.agreed(v[self.world:]))
        return max(self._active_ranks(v))

    # the strategy's step, zero_grad and clip ask first (True: skip it, a deferred sync)
    def before_step(self, optimizer: torch.optim.Optimizer, precision: Any) -> bool:
        return self.agreement.skip_step()

    def before_zero_grad(self, optimizer: torch.optim.Optimizer, set_to_none: bool) -> bool:
        return self.agreement.skip_zero_grad()

    def before_clip(self, max_norm: float, norm_type: float) -> bool:
        return self.agreement.skip_clip()

    def shadow(self) -> bool:
        """A rank out of inputs: mirror the active ranks' collectives until every rank is out. True when no rank was
        still active at this rank's first check (it is one of the last to finish)."""
        # the first sync mirrored takes this rank's gradients when its own last sync was deferred (they count once)
        held = set(range(len(self.models))) if self.agreement.deferred is not None else set()
        self.agreement.end()
        last = True
        while True:
            for k, model in enumerate(self.models):
                v = self._exchange(None)
                active = self._active_ranks(v)
                if not active:
                    if k == 0:
                        return last
                    raise RuntimeError("join_uneven_inputs: the ranks still training did not run a forward of every "
                                       f"joined model in each iteration (model {k} of {len(self.models)} got none)")
                last = False
                sync = SyncAgreement.agreed(v[self.world:])
                model._shadow_forward(max(active), sync, keep=k in held)
                if sync:
                    held.discard(k)

    def close(self) -> None:
        self.agreement.end()

    def finish(self, last: bool) -> None:
        """Every rank is out: all take the parameters and buffers of the highest rank among the last to finish."""
        v = self._exchange([0.0] * NFIELDS if last else None)
        src = max(self._active_ranks(v))
        for model in self.models:
            self.strategy.broadcast(list(model.module.parameters()) + list(model.module.buffers()), src=src)
