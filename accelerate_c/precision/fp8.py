# accelerate_c/precision/fp8.py: mixed_precision="fp8": nn.Linear layers are swapped for FP8Linear, which casts its
# input, weight and (in backward) output gradient to float8 with per-tensor scales, using
# accelerate_c.precision.cast.cast (scale, RNE, saturation and amax in one pass). Scaling is either current
# (dynamic: scale from this tensor's amax) or delayed (scale from an amax history of earlier steps, the
# new amax recorded in the same cast pass). Format E4M3 everywhere, or HYBRID: e4m3 forward, e5m2 grads.
# On a GPU with fp8 support the forward matmul uses torch._scaled_mm; elsewhere it computes on the
# dequantised values (same numerics, no speed-up).
# Tensor-parallel linears (the TP engine's classes, marked `fp8_attachable`) are not swapped: they get the same three
# scaling states, whose amax is agreed (max) over the layer's TP group, so a sliced tensor is scaled as the whole
# one would be, and quantise through the states' own fake_quant / grad_quant (forward casts, straight-through
# gradients) when ScaleState.quantises says so: the layers need nothing else from this module.
# recompute_context_fn: activation checkpointing's recomputation quantises with the scales its forward used.
# scaling_state / load_scaling_state: the amax histories as plain data, for save_state (checkpointing/scaling.py).
# Not for: fp16/bf16 (precision.py) or the cast kernel itself (ops.py, csrc/ops/cast.c).
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import torch

from ..base import settings
from .policy import Precision

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8_MAX = {E4M3: 448.0, E5M2: 57344.0}


@dataclass
class FP8Config:
    fp8_format: str = "HYBRID"          # "E4M3" or "HYBRID"
    use_delayed_scaling: bool = False
    amax_history_len: int = 16
    amax_compute_algo: str = "max"      # "max" or "most_recent"
    margin: int = 0
    module_filter_func: Optional[Callable[[torch.nn.Module, str], bool]] = None
    use_autocast_during_eval: bool = False  # HF (Transformer Engine recipe): fp8 layers compute in high precision
    #                                         in eval mode unless this is set

    @classmethod
    def from_handler(cls, handler: Any) -> "FP8Config":
        cfg = cls()
        env = {"fp8_format": "ACCELERATE_FP8_FORMAT", "amax_history_len": "ACCELERATE_FP8_AMAX_HISTORY_LEN",
               "amax_compute_algo": "ACCELERATE_FP8_AMAX_COMPUTE_ALGO", "margin": "ACCELERATE_FP8_MARGIN",
               "use_delayed_scaling": "ACCELERATE_FP8_DELAYED_SCALING",
               "use_autocast_during_eval": "ACCELERATE_FP8_USE_AUTOCAST_DURING_EVAL"}
        for name, var in env.items():
            value = getattr(handler, name, None) if handler is not None else None
            if value is None:
                value = _from_env(var, getattr(cfg, name))
            if value is not None:
                setattr(cfg, name, value)
        if handler is not None and getattr(handler, "module_filter_func", None) is not None:
            cfg.module_filter_func = handler.module_filter_func
        cfg.fp8_format = str(cfg.fp8_format).upper()
        if cfg.fp8_format not in ("E4M3", "HYBRID"):
            raise ValueError(f"fp8_format={cfg.fp8_format!r} is not supported; allowed: E4M3, HYBRID")
        if cfg.amax_compute_algo not in ("max", "most_recent"):
            raise ValueError(f"amax_compute_algo={cfg.amax_compute_algo!r}; allowed: max, most_recent")
        if cfg.amax_history_len < 1:
            raise ValueError(f"amax_history_len must be >= 1, got {cfg.amax_history_len}")
        return cfg


def _from_env(var: str, current: Any) -> Any:
    """HF's ACCELERATE_FP8_* variable `var` in the type of the field's default (None when unset or empty);
    a value that is not of that type is an error naming the variable."""
    if not settings.env_value(var):
        return None
    if isinstance(current, bool):
        return settings.env_flag(var, None)
    if isinstance(current, int):
        return settings.env_int(var)
    return settings.env_value(var)


class ScaleState:
    """Per-tensor scaling state: the amax history (delayed scaling) and the scale last used."""

    def __init__(self, dtype: torch.dtype, cfg: FP8Config,
                 reduce: Optional[Callable[[float], float]] = None) -> None:
        self.dtype, self.cfg = dtype, cfg
        self.history: list[float] = []
        self.reduce = reduce  # the amax agreed over the ranks holding slices of the tensor (None: this rank's)

    def _scale_from(self, amax: float) -> float:
        if not (amax > 0.0) or amax == float("inf"):
            return 1.0
        return FP8_MAX[self.dtype] / amax / (2.0 ** self.cfg.margin)

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, float]:
        """Returns (x cast to fp8, scale). Delayed scaling casts with the history's scale and records
        this tensor's amax from the same pass; current scaling computes amax first."""
        from .cast import cast
        if self.cfg.use_delayed_scaling and self.history:
            amax_hist = max(self.history) if self.cfg.amax_compute_algo == "max" else self.history[-1]
            scale = self._scale_from(amax_hist)
            q, amax = cast(x, self.dtype, scale=scale, return_amax=True)
            self._record(self._agreed(float(amax)))
            return q, scale
        amax = self._agreed(float(x.detach().abs().max()) if x.numel() else 0.0)
        scale = self._scale_from(amax)
        q = cast(x, self.dtype, scale=scale)
        if self.cfg.use_delayed_scaling:
            self._record(amax)
        return q, scale

    def quantises(self, training: bool) -> bool:
        """Whether the layer holding this state quantises in a forward in this mode: in training always; in eval
        only with the recipe's use_autocast_during_eval (HF's Transformer Engine rule: evaluation in high precision
        by default). No amax is recorded in a forward that does not quantise."""
        return training or self.cfg.use_autocast_during_eval

    def fake_quant(self, t: torch.Tensor) -> torch.Tensor:
        """t cast to fp8 with this state's scale and back (what an fp8 matmul sees); gradient straight through."""
        return _FakeQuant.apply(t, self)

    def grad_quant(self, y: torch.Tensor) -> torch.Tensor:
        """y unchanged; in backward its gradient is cast to fp8 with this state's scale and back."""
        return _GradQuant.apply(y, self)

    def _agreed(self, amax: float) -> float:
        return amax if self.reduce is None else self.reduce(amax)

    def _record(self, amax: float) -> None:
        self.history.append(amax)
        if len(self.history) > self.cfg.amax_history_len:
            del self.history[0]


def _dequant(q: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    return q.to(torch.float32).mul_(1.0 / scale).to(dtype)


def _use_scaled_mm(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """torch._scaled_mm (the fp8 tensor cores) for this product: a CUDA device of compute capability 8.9 or more
    (Ada, Hopper) and every dimension a multiple of 16, as cuBLASLt's fp8 GEMM requires; else the CPU's emulation
    (dequantised operands, a product in the input dtype)."""
    return (x.is_cuda and hasattr(torch, "_scaled_mm") and x.shape[0] % 16 == 0 and x.shape[1] % 16 == 0
            and weight.shape[0] % 16 == 0 and torch.cuda.get_device_capability(x.device) >= (8, 9))


class _FP8LinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                module: "FP8Linear") -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        xq, sx = module.x_state.quantize(x2)
        wq, sw = module.w_state.quantize(weight)
        if _use_scaled_mm(x2, weight):
            out = torch._scaled_mm(xq, wq.t(), scale_a=torch.tensor(1.0 / sx, device=x.device),
                                   scale_b=torch.tensor(1.0 / sw, device=x.device), out_dtype=x.dtype)
        else:
            out = _dequant(xq, sx, x.dtype) @ _dequant(wq, sw, weight.dtype).t()
        if bias is not None:
            out = out + bias
        ctx.save_for_backward(xq, wq)
        ctx.scales, ctx.module, ctx.shape, ctx.has_bias = (sx, sw), module, shape, bias is not None
        ctx.dtypes = (x.dtype, weight.dtype)
        return out.reshape(*shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> Any:
        xq, wq = ctx.saved_tensors
        sx, sw = ctx.scales
        g2 = grad_out.reshape(-1, grad_out.shape[-1])
        gq, sg = ctx.module.g_state.quantize(g2)
        g = _dequant(gq, sg, torch.float32)
        grad_x = (g @ _dequant(wq, sw, torch.float32)).to(ctx.dtypes[0]).reshape(ctx.shape)
        grad_w = (g.t() @ _dequant(xq, sx, torch.float32)).to(ctx.dtypes[1])
        grad_b = g2.sum(0).to(ctx.dtypes[1]) if ctx.has_bias else None
        return grad_x, grad_w, grad_b, None


class FP8Linear(torch.nn.Linear):
    """Drop-in for nn.Linear; keeps the original Parameters (so optimizers built before prepare work). A Linear
    subclass (as torchao's Float8Linear) so initialisers that test isinstance(m, nn.Linear) (transformers'
    _init_weights, nn.Linear.reset_parameters) still initialise it: sharded construction converts, then initialises."""

    def __init__(self, linear: torch.nn.Linear, cfg: FP8Config) -> None:
        torch.nn.Module.__init__(self)  # (not Linear's: it would allocate new parameters)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        grad_dtype = E5M2 if cfg.fp8_format == "HYBRID" else E4M3
        self.x_state, self.w_state = ScaleState(E4M3, cfg), ScaleState(E4M3, cfg)
        self.g_state = ScaleState(grad_dtype, cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not fp8_active(self):
            return torch.nn.functional.linear(x, self.weight, self.bias)
        return _FP8LinearFn.apply(x, self.weight, self.bias, self)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class _FakeQuant(torch.autograd.Function):
    """t cast to fp8 with `state`'s scale and back (what the matmul of an fp8 layer sees); gradient straight through."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, state: ScaleState) -> torch.Tensor:
        q, s = state.quantize(t.detach())
        return _dequant(q, s, t.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        return grad, None


class _GradQuant(torch.autograd.Function):
    """Identity forward; backward casts the output gradient to fp8 with `state` (FP8Linear's g_state) and back."""

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, state: ScaleState) -> torch.Tensor:
        ctx.state = state
        return y.view_as(y)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        q, s = ctx.state.quantize(grad.contiguous())
        return _dequant(q, s, torch.float32).to(grad.dtype), None


def attach_fp8(module: torch.nn.Module, cfg: FP8Config) -> None:
    """Gives a tensor-parallel linear (fp8_attachable) FP8Linear's three scaling states, their amax agreed over its
    group (module.amax_reduce); the layer then quantises itself through them (tensor_parallel/linear.py)."""
    grad_dtype = E5M2 if cfg.fp8_format == "HYBRID" else E4M3
    reduce = module.amax_reduce
    module.x_state, module.w_state = ScaleState(E4M3, cfg, reduce), ScaleState(E4M3, cfg, reduce)
    module.g_state = ScaleState(grad_dtype, cfg, reduce)


def is_fp8_layer(m: torch.nn.Module) -> bool:
    """An FP8Linear, or a tensor-parallel linear given the fp8 scaling states (attach_fp8)."""
    return isinstance(m, FP8Linear) or (getattr(m, "fp8_attachable", False) and hasattr(m, "g_state"))


def fp8_active(m: torch.nn.Module) -> bool:
    """Whether fp8 layer `m` quantises in this forward (ScaleState.quantises: the one rule)."""
    return m.x_state.quantises(m.training)


def recompute_context_fn(module: torch.nn.Module) -> Optional[Callable[[], tuple]]:
    """For torch.utils.checkpoint(context_fn=...) around `module` (activation checkpointing): its FP8Linear layers'
    forward scaling state (input and weight amax histories) is set back, for the recomputation in backward, to what
    the forward started from, and restored after it: under delayed scaling the recomputed activations then equal the
    forward's and no amax is recorded twice. None when the module holds no FP8Linear."""
    states = [s for m in module.modules() if is_fp8_layer(m) for s in (m.x_state, m.w_state)]
    if not states:
        return None

    def context_fn() -> tuple:
        start: list[list[float]] = []

        @contextlib.contextmanager
        def forward() -> Iterator[None]:
            start[:] = [list(s.history) for s in states]
            yield

        @contextlib.contextmanager
        def recompute() -> Iterator[None]:
            live = [s.history for s in states]
            for s, h in zip(states, start):
                s.history = list(h)
            try:
                yield
            finally:
                for s, h in zip(states, live):
                    s.history = h
        return forward(), recompute()
    return context_fn


_STATES = ("x", "w", "g")  # FP8Linear.x_state (input), w_state (weight), g_state (output gradient)


def scaling_state(model: torch.nn.Module) -> dict[str, dict[str, list[float]]]:
    """The amax histories of every FP8Linear in `model`, by module name: {name: {"x": [...], "w": [...], "g":
    [...]}} (copies; empty lists under current scaling). {} when the model holds no FP8Linear. What save_state
    writes per rank (checkpointing/scaling.py): with it a resumed run quantises as the uninterrupted one."""
    return {name: {k: list(getattr(m, f"{k}_state").history) for k in _STATES}
            for name, m in model.named_modules() if is_fp8_layer(m)}


def load_scaling_state(model: torch.nn.Module, state: Optional[dict], strict: bool = True) -> list[str]:
    """Sets the amax histories of `model`'s FP8Linear layers from a scaling_state() dict; None or {} empties them
    all (a checkpoint without fp8 state: the first casts use current scaling, as in a fresh run). A history
    longer than this run's amax_history_len keeps its newest entries. When a non-empty `state` misses layers of
    the model or names layers the model lacks: ValueError naming them if strict, else the missing layers are
    emptied and the others ignored. Nothing is changed unless the whole state is valid. Returns the names of the
    layers left empty for want of saved state."""
    layers = {name: m for name, m in model.named_modules() if is_fp8_layer(m)}
    state = {} if state is None else state
    if not isinstance(state, dict):
        raise ValueError(f"fp8 scaling state must be a dict of layer name -> histories, got {type(state).__name__}")
    missing = sorted(set(layers) - set(state))
    unexpected = sorted(set(state) - set(layers))
    if strict and state and (missing or unexpected):
        raise ValueError(f"fp8 scaling state does not match the model's FP8Linear layers: missing {missing}, "
                         f"unexpected {unexpected}")
    new: list[tuple[ScaleState, list[float]]] = []
    for name, m in layers.items():
        entry = state.get(name)
        for k in _STATES:
            hist = [] if entry is None else entry.get(k) if isinstance(entry, dict) else None
            if not isinstance(hist, list) or not all(isinstance(a, float) for a in hist):
                raise ValueError(f"fp8 scaling state of layer {name!r}: {k!r} must be a list of floats, "
                                 f"got {hist!r}")
            st = getattr(m, f"{k}_state")
            new.append((st, list(hist[max(0, len(hist) - st.cfg.amax_history_len):])))
    for st, hist in new:
        st.history = hist
    return missing


def uses_delayed_scaling(model: torch.nn.Module) -> bool:
    return any(m.x_state.cfg.use_delayed_scaling for m in model.modules() if is_fp8_layer(m))


def convert_to_fp8(model: torch.nn.Module, cfg: FP8Config) -> torch.nn.Module:
    """Swaps every nn.Linear the filter accepts (default: all) for FP8Linear, in place; a tensor-parallel linear gets
    the scaling states instead (attach_fp8)."""
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            full = f"{name}.{child_name}" if name else child_name
            if cfg.module_filter_func is not None and not cfg.module_filter_func(child, full):
                continue
            if type(child) is torch.nn.Linear:
                setattr(module, child_name, FP8Linear(child, cfg))
            elif getattr(child, "fp8_attachable", False) and not hasattr(child, "g_state"):
                attach_fp8(child, cfg)
    return model


class FP8Precision(Precision):
    mode = "fp8"

    def __init__(self, device: torch.device, handlers: dict[str, Any], fused_kernels: bool = True) -> None:
        super().__init__(device, handlers, fused_kernels)
        self.cfg = FP8Config.from_handler(handlers.get("FP8RecipeKwargs"))

    def prepare_model(self, model: torch.nn.Module) -> torch.nn.Module:
        if not getattr(model, "_accelerate_c_fp8", False):
            convert_to_fp8(model, self.cfg)
            model._accelerate_c_fp8 = True
        return model
