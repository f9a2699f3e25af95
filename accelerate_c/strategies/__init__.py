# accelerate_c/strategies: one backend per module, found through a registry.
# `select_strategy` asks each registered Strategy class whether it applies to this run (its own
# `applies` classmethod) and picks the highest priority, so the Accelerator never branches on a backend.
# Not for: backend code itself (each lives in its own module here).
from __future__ import annotations

import importlib
import pkgutil
from typing import Callable

from .base import Strategy, StrategyContext

REGISTRY: dict[str, type[Strategy]] = {}


def register(name: str) -> Callable[[type[Strategy]], type[Strategy]]:
    def deco(cls: type[Strategy]) -> type[Strategy]:
        cls.name = name
        REGISTRY[name] = cls
        return cls
    return deco


_loaded = False


def _load_all() -> None:
    """Imports every backend module once (each registers itself). Whether some were imported before (e.g. a
    test importing strategies.ddp_bucketed first) does not matter: the registry is complete afterwards."""
    global _loaded
    if _loaded:
        return
    for mod in pkgutil.iter_modules(__path__):
        if mod.name not in ("base",):
            importlib.import_module(f"{__name__}.{mod.name}")
    _loaded = True


def select_strategy(ctx: StrategyContext) -> Strategy:
    _load_all()
    candidates = [cls for cls in REGISTRY.values() if cls.applies(ctx.state, ctx.handlers)]
    if not candidates:
        raise RuntimeError(f"no strategy applies to this run ({ctx.state.distributed_type}, "
                           f"{ctx.state.num_processes} processes); registered: {sorted(REGISTRY)}")
    cls = max(candidates, key=lambda c: c.priority)
    return cls(ctx)


__all__ = ["REGISTRY", "Strategy", "StrategyContext", "register", "select_strategy"]
