# _fused.py: runs one step of a torch Adam/AdamW/SGD optimizer (ours or torch's own object) with the C kernels,
# on the optimizer's own param_groups and state (torch's layout), so state_dict, schedulers and checkpoints keep
# working. Also the decision of which groups the kernels can take (dense, real fp32, contiguous, on the CPU or on one
# CUDA device where accelerate_c._C_cuda serves it: optim/cuda.py).
# A caller may pass a `partition` that cuts the kernels' lists to one slice of every tensor (a step split
# between processes); this file only calls its three methods and knows nothing of who provides it.
# Not for: the optimizer classes (adamw.py, sgd.py), flat-buffer calls (flat.py) or deciding when to use the
# kernels or split a step (the strategies' step, accelerate_c/strategies/).
from __future__ import annotations

from typing import Any

import torch
from torch.optim.optimizer import _get_scalar_dtype

from .. import _C
from ..base.dtypes import C_FLOAT_INPUTS, LOW_PRECISION
from . import cuda, lowbit

_GRAD_DTYPES = C_FLOAT_INPUTS
_LP_DTYPES = LOW_PRECISION


def optimizer_kind(optimizer: torch.optim.Optimizer) -> str | None:
    """'adam' or 'sgd' for torch's Adam/AdamW/SGD and our subclasses; None for anything else (a user subclass
    of torch's classes may override step(), so only the exact classes and ours are taken)."""
    t = type(optimizer)
    if t in (torch.optim.Adam, torch.optim.AdamW):
        return "adam"
    if t is torch.optim.SGD:
        return "sgd"
    kind = t.__dict__.get("fused_kind")  # set by accelerate_c's own classes only, not inherited by subclasses
    if kind is not None:
        return kind
    return None


def _num(x: Any) -> float:
    return float(x.item()) if isinstance(x, torch.Tensor) else float(x)


def group_device(group: dict) -> torch.device | None:
    """The device of the group's first param with a gradient (None: no gradient): where its kernels run."""
    return next((p.device for p in group["params"] if p.grad is not None), None)


def group_supported(kind: str, group: dict) -> bool:
    """True when every param with a gradient in `group` can go through the kernels: the C ones for CPU tensors, the
    CUDA ones (optim/cuda.py, when built and a GPU is seen) for CUDA tensors, all on one device."""
    if group.get("differentiable", False):
        return False
    dev = group_device(group)
    on_cuda = dev is not None and dev.type == "cuda"
    if on_cuda and (kind == "sgd" and isinstance(group["lr"], torch.Tensor) or cuda.kernels() is None):
        return False
    if kind == "adam":
        if group.get("capturable", False) and not on_cuda:  # (capturable: step counts on the device, read there)
            return False
        b1, b2 = group["betas"]
        if isinstance(b1, torch.Tensor) and b1.requires_grad or isinstance(b2, torch.Tensor) and b2.requires_grad:
            return False
    wd = group["weight_decay"]
    if isinstance(wd, torch.Tensor) and wd.requires_grad:
        return False
    lr = group["lr"]
    if isinstance(lr, torch.Tensor) and (lr.requires_grad or not (lr.is_cpu or (lr.device == dev and lr.numel() == 1
                                                                               and lr.dtype == torch.float32))):
        return False
    cpu = not on_cuda
    for p in group["params"]:
        g = p.grad
        if g is None:
            continue
        # is_cpu rather than device.type: the same test without building a device object per tensor (this runs
        # for every param on every step)
        if ((p.is_cpu != cpu) or (not cpu and (p.device != dev or g.device != dev)) or p.dtype != torch.float32
                or p.is_sparse or g.is_sparse or g.is_cpu != cpu or g.dtype not in _GRAD_DTYPES
                or not p.is_contiguous() or not g.is_contiguous() or g.shape != p.shape):
            return False
    return True


def _state_ok(t: torch.Tensor | None, p: torch.Tensor) -> bool:
    return t is None or (t.device == p.device and t.dtype == torch.float32 and t.is_contiguous() and t.shape == p.shape)


def _lp_for(low_precision_copies: dict | None, p: torch.Tensor) -> torch.Tensor | None:
    if not low_precision_copies:
        return None
    lp = low_precision_copies.get(p)
    if lp is not None and (lp.dtype not in _LP_DTYPES or lp.device != p.device or not lp.is_contiguous()
                           or lp.numel() != p.numel()):
        raise ValueError("low_precision_copies: each copy must be a contiguous bfloat16/float16 tensor on its param's "
                         "device with as many elements as the param")
    return lp


def _adam_group_lists(opt: torch.optim.Optimizer, group: dict, low_precision_copies: dict | None, salts: dict):
    """Lists for one _C.adam_step call; lazily creates the state exactly like torch's _init_group (in the group's
    state_dtype layout, lowbit.py). Returns None when an existing fp32 state tensor cannot be used in place (the
    caller then falls back to torch); a low-precision state that cannot is an error (no torch fallback)."""
    params, grads, ms, vs, maxs, steps, lps = [], [], [], [], [], [], []
    ams, avs, salt = [], [], []
    amsgrad = group["amsgrad"]
    fresh = [(p, lowbit.layout_for(group, p)) for p in group["params"] if p.grad is not None and len(opt.state[p]) == 0]
    made = {id(p): st for (p, _), st in zip(fresh, lowbit.new_states(fresh))}  # one mapping for the call's states
    for p in group["params"]:
        if p.grad is None:
            continue
        state = opt.state[p]
        layout = lowbit.layout_for(group, p)
        if len(state) == 0:
            on_device = group.get("fused") or group.get("capturable")  # torch keeps those steps on the param's device
            state["step"] = (torch.zeros((), dtype=_get_scalar_dtype(is_fused=True), device=p.device) if on_device
                             else torch.tensor(0.0, dtype=_get_scalar_dtype()))
            state.update(made[id(p)])
            if amsgrad:
                state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        elif layout != "float32" or lowbit.layout_of(state) != "float32":
            lowbit.convert(state, p, layout)  # e.g. state assigned from another layout
        step = state["step"]
        mx = state.get("max_exp_avg_sq") if amsgrad else None
        if amsgrad and mx is None:
            return None
        if (not isinstance(step, torch.Tensor) or step.numel() != 1 or step.dtype not in (torch.float32, torch.float64)
                or not (step.is_cpu or (step.device == p.device and step.dtype == torch.float32))):
            return None  # (a CUDA param's step may live on its device: the kernels read and advance it there)
        if layout == "float32":
            if not _state_ok(state["exp_avg"], p) or not _state_ok(state["exp_avg_sq"], p) or not _state_ok(mx, p):
                return None
            ams.append(None)
            avs.append(None)
        else:
            bad = lowbit.check_state(state, p, layout)
            if bad:
                raise ValueError(f"state_dtype={layout!r}: {bad} (param of shape {tuple(p.shape)})")
            ams.append(state.get("exp_avg_absmax"))
            avs.append(state.get("exp_avg_sq_absmax"))
        params.append(p)
        grads.append(p.grad)
        ms.append(state["exp_avg"])
        vs.append(state["exp_avg_sq"])
        salt.append(salts.get(id(p), 0))
        if amsgrad:
            maxs.append(mx)
        steps.append(step)
        lps.append(_lp_for(low_precision_copies, p))
    low = (ams, avs, salt) if group.get("state_dtype", "float32") != "float32" else None
    return (params, grads, ms, vs, (maxs if amsgrad else None), steps, (lps if low_precision_copies else None), low)


def _sgd_group_lists(opt: torch.optim.Optimizer, group: dict, low_precision_copies: dict | None):
    params, grads, bufs, lps = [], [], [], []
    use_mom = group["momentum"] != 0
    for p in group["params"]:
        if p.grad is None:
            continue
        buf = None
        if use_mom:
            buf = opt.state[p].get("momentum_buffer")
            if buf is not None and not _state_ok(buf, p):
                return None
        params.append(p)
        grads.append(p.grad)
        bufs.append(buf)
        lps.append(_lp_for(low_precision_copies, p))
    return params, grads, bufs, lps


def run_groups(opt: torch.optim.Optimizer, kind: str, groups: list[dict], *, grad_scale: float | None = None,
               skip_if_nonfinite: bool = False, low_precision_copies: dict | None = None,
               num_threads: int | None = None, partition: Any = None) -> bool | None:
    """Steps `groups` of `opt` (all must pass group_supported). Returns True (stepped), None (skipped: a
    gradient times grad_scale was inf/NaN; nothing changed) or False (a state tensor is unusable; nothing
    changed). `partition`: only a slice of each tensor is stepped. Once the lists are built (nothing changed
    yet) it is called as `begin()`; `slice_lists(opt, params, grads, {state key: list}, lps)` -> (cut, mirrors,
    offsets) cuts each group's lists in place (`mirrors`: per entry a tensor the kernel also writes the new
    values into, or None; `offsets`: the slice's first element in its param); `end(cut)` after the kernels."""
    cut: list = []
    nthreads = num_threads or torch.get_num_threads()
    scale = 1.0 if grad_scale is None else _num(grad_scale)
    if partition is not None and any(not _on_cpu(g) for g in groups):
        return False  # a split step is the CPU's (shared-memory replicas)
    if skip_if_nonfinite and _any_nonfinite(groups, scale, nthreads):
        return None
    if kind == "adam":
        salts = {id(p): i for i, p in enumerate(p for g in opt.param_groups for p in g["params"])}
        lists = [_adam_group_lists(opt, g, low_precision_copies, salts) for g in groups]
        if any(x is None for x in lists):
            return False
        default_decoupled = isinstance(opt, torch.optim.AdamW)
        mirrors: list = [None] * len(lists)
        offsets: list = [None] * len(lists)
        if partition is not None:
            partition.begin()
            for j, (params, grads, ms, vs, maxs, steps, lps, low) in enumerate(lists):
                keyed = {"exp_avg": ms, "exp_avg_sq": vs, "max_exp_avg_sq": maxs or None}
                if low is not None:
                    keyed.update(exp_avg_absmax=low[0], exp_avg_sq_absmax=low[1])
                c, mirrors[j], offsets[j] = partition.slice_lists(opt, params, grads, keyed, lps)
                cut += c
        for g, lst, mir, offs in zip(groups, lists, mirrors, offsets):
            _adam_call(g, lst, mir, offs, default_decoupled, scale, nthreads)
    else:
        lists = [_sgd_group_lists(opt, g, low_precision_copies) for g in groups]
        if any(x is None for x in lists):
            return False
        if partition is not None:
            partition.begin()
        for g, (params, grads, bufs, lps) in zip(groups, lists):
            use_mom = g["momentum"] != 0
            inits = None
            if use_mom:
                inits = [b is None for b in bufs]
                for i, p in enumerate(params):
                    if bufs[i] is None:  # torch's first step: the buffer is a clone of the gradient
                        bufs[i] = torch.empty_like(p, memory_format=torch.contiguous_format)
                        if partition is not None:  # stored now: the state keeps the whole slot, the kernel a slice
                            opt.state[p]["momentum_buffer"] = bufs[i]
            mir = None
            if partition is not None:
                state = {"momentum_buffer": bufs if use_mom else None}
                c, mir, _ = partition.slice_lists(opt, params, grads, state, lps)
                cut += c
            args = (params, grads, bufs if use_mom else None, inits, lps, _num(g["lr"]), float(g["momentum"]),
                    float(g["dampening"]), _num(g["weight_decay"]), bool(g["nesterov"]), bool(g["maximize"]), scale)
            if _on_cpu(g):
                _C.sgd_step(*args, nthreads, mir)
            else:
                cuda.sgd_step(group_device(g), *args)
            if use_mom and partition is None:
                for p, b, new in zip(params, bufs, inits):
                    if new:
                        opt.state[p]["momentum_buffer"] = b
    if partition is not None:
        partition.end(cut)
    return True


def _on_cpu(group: dict) -> bool:
    dev = group_device(group)
    return dev is None or dev.type == "cpu"


def _any_nonfinite(groups: list[dict], scale: float, nthreads: int) -> bool:
    """Whether a gradient times `scale` is inf/NaN: the CPU ones by the C kernel, the CUDA ones on their device and
    read back here (the only host read of a CUDA step, and only when the caller asks to skip on non-finite
    gradients: fp16 on CUDA takes GradScaler's path instead)."""
    cpu = [p.grad for g in groups for p in g["params"] if p.grad is not None and p.grad.is_cpu]
    dev: dict = {}
    for g in groups:
        for p in g["params"]:
            if p.grad is not None and not p.grad.is_cpu:
                dev.setdefault(p.grad.device, []).append(p.grad)
    if cpu and _C.grads_nonfinite(cpu, scale, nthreads):
        return True
    return any(bool(cuda.nonfinite_flag(grads, scale).item()) for grads in dev.values())


def _adam_call(g: dict, lists: tuple, mir: Any, offs: Any, default_decoupled: bool, scale: float,
               nthreads: int) -> None:
    """One group's kernel call: the C kernel for CPU tensors, the CUDA one for CUDA tensors (its lr may be a float32
    tensor on the device, read there; step counts on the device are read and advanced there)."""
    params, grads, ms, vs, maxs, steps, lps, low = lists
    b1, b2 = g["betas"]
    lr = g["lr"]
    lr_f32 = isinstance(lr, torch.Tensor) and lr.dtype == torch.float32
    head = (params, grads, ms, vs, maxs, steps, lps, lr if isinstance(lr, torch.Tensor) and lr.is_cuda else _num(lr),
            _num(b1), _num(b2), float(g["eps"]), _num(g["weight_decay"]),
            bool(g.get("decoupled_weight_decay", default_decoupled)), bool(g["amsgrad"]), bool(g["maximize"]), scale)
    if _on_cpu(g):
        _C.adam_step(*head, nthreads, lr_f32, *((mir,) if low is None else (mir, low[0], low[1], offs, low[2])))
    else:
        cuda.adam_step(group_device(g), *head, lr_f32, low=None if low is None else (low[0], low[1], offs, low[2]))


def fused_step(optimizer: torch.optim.Optimizer, *, grad_scale: float | torch.Tensor | None = None,
               skip_if_nonfinite: bool = False, low_precision_copies: dict | None = None,
               num_threads: int | None = None, partition: Any = None) -> bool | None:
    """One step of a torch (or accelerate_c) Adam/AdamW/SGD optimizer through the fused C kernels, on its own
    param_groups and state (torch's layout; the object stays a normal torch optimizer).

    grad_scale: every gradient is multiplied by this factor inside the pass (e.g. 1/loss_scale times a clip
    coefficient); the .grad tensors themselves are not modified.
    skip_if_nonfinite: check all gradients (times grad_scale) first; if any is inf/NaN nothing is changed
    (no param, state or step counter; like GradScaler skipping optimizer.step()).
    low_precision_copies: {fp32 param: bf16/fp16 tensor of the same numel} written with the updated param in
    the same pass (RNE, equal to param.to(dtype) on finite values).

    Returns True: stepped. None: skipped because of a non-finite gradient (do NOT call optimizer.step()).
    False: unsupported configuration (other class, sparse/complex/non-fp32/non-contiguous params, CUDA params
    without the CUDA kernels (optim/cuda.py), differentiable, capturable on the CPU, tensor betas with grad, step
    hooks registered, AMP grad_scale/found_inf attributes set): nothing was done, call optimizer.step() instead.
    Test with `is False`.
    partition: step only a slice of every tensor (run_groups describes the protocol).
    """
    kind = optimizer_kind(optimizer)
    r: bool | None = False
    if kind is not None and _kernels_take(optimizer, kind):
        with torch.no_grad():
            r = run_groups(optimizer, kind, optimizer.param_groups, grad_scale=grad_scale,
                           skip_if_nonfinite=skip_if_nonfinite, low_precision_copies=low_precision_copies,
                           num_threads=num_threads, partition=partition)
    if r:
        optimizer._opt_called = True  # what torch's LR scheduler wrapper of step() records
    return r


def _kernels_take(optimizer: torch.optim.Optimizer, kind: str) -> bool:
    if getattr(optimizer, "grad_scale", None) is not None or getattr(optimizer, "found_inf", None) is not None:
        return False
    from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks

    if (optimizer._optimizer_step_pre_hooks or optimizer._optimizer_step_post_hooks or _global_optimizer_pre_hooks
            or _global_optimizer_post_hooks):
        return False
    return all(group_supported(kind, g) for g in optimizer.param_groups)
