# accelerate_c/base/environment.py: HF's environment-variable context managers (`patch_environment`,
# `clear_environment`) and `are_libraries_initialized`, with HF 1.15's semantics.
# Not for: reading accelerate_c's own settings from the environment (base/settings.py owns every ACCELERATE_C_*
# variable; HF's plugin dataclasses read HF's own variables where HF reads them).
from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from typing import Any, Iterator


@contextmanager
def clear_environment() -> Iterator[None]:
    """Empties os.environ for the block; on exit the previous environment comes back exactly (variables the
    block added are dropped, the ones it changed or removed are restored)."""
    saved = os.environ.copy()
    os.environ.clear()
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


@contextmanager
def patch_environment(**kwargs: Any) -> Iterator[None]:
    """Sets each keyword as an environment variable for the block: the key upper-cased, the value str()'d.
    On exit a variable that existed before gets its old value back and a new one is removed."""
    previous: dict[str, str] = {}
    for key, value in kwargs.items():
        key = key.upper()
        if key in os.environ:
            previous[key] = os.environ[key]
        os.environ[key] = str(value)
    try:
        yield
    finally:
        for key in kwargs:
            key = key.upper()
            if key in previous:
                os.environ[key] = previous[key]
            else:
                os.environ.pop(key, None)


def are_libraries_initialized(*library_names: str) -> list[str]:
    """The names among `library_names` that are already imported in this process."""
    return [name for name in library_names if name in sys.modules]
