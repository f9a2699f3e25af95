# accelerate_c/base/environment.py: HF's environment-variable context managers (`patch_environment`,
# `clear_environment`), `are_libraries_initialized`, the readers HF exports for users' own variables
# (`get_int_from_env`, `parse_flag_from_env`, `parse_choice_from_env`) and the `purge_accelerate_environment`
# decorator, with HF 1.15's semantics.
# Not for: reading accelerate_c's own settings from the environment (base/settings.py owns every ACCELERATE_C_*
# variable; HF's plugin dataclasses read HF's own variables where HF reads them).
from __future__ import annotations

import functools
import os
import sys
from contextlib import contextmanager
from typing import Any, Callable, Iterable, Iterator

from .imports import str_to_bool


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


def get_int_from_env(env_keys: Iterable[str], default: Any) -> Any:
    """The first of `env_keys` set to an integer >= 0 (unset counts as -1), else `default`; a non-integer value
    raises ValueError."""
    for key in env_keys:
        value = int(os.environ.get(key, -1))
        if value >= 0:
            return value
    return default


def parse_flag_from_env(key: str, default: bool = False) -> bool:
    """Variable `key` read as a boolean (y/yes/t/true/on/1 or n/no/f/false/off/0; else ValueError), or `default`."""
    return str_to_bool(os.environ.get(key, str(default))) == 1


def parse_choice_from_env(key: str, default: str = "no") -> str:
    """Variable `key` as it is, or str(default)."""
    return os.environ.get(key, str(default))


_PREFIX = "ACCELERATE_"


@contextmanager
def _accelerate_variables_restored() -> Iterator[None]:
    saved = {k: v for k, v in os.environ.items() if k.startswith(_PREFIX)}
    try:
        yield
    finally:
        for key in [k for k in os.environ if k.startswith(_PREFIX)]:
            if key in saved:
                os.environ[key] = saved[key]
            else:
                del os.environ[key]


def purge_accelerate_environment(func_or_cls: Callable) -> Callable:
    """Decorator: the ACCELERATE_* variables a function (or each test* method of a class and of its subclasses)
    sets or changes are put back as they were when it returns or raises, e.g. the ACCELERATE_MIXED_PRECISION that
    transformers' TrainingArguments(fp16=True) leaves behind."""
    def wrap(func: Callable) -> Callable:
        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with _accelerate_variables_restored():
                return func(*args, **kwargs)
        wrapper._accelerate_is_purged_environment_wrapped = True
        return wrapper

    if not isinstance(func_or_cls, type):
        return wrap(func_or_cls)

    def wrap_tests(cls: type) -> type:
        for name in dir(cls):
            method = getattr(cls, name)
            if name.startswith("test") and callable(method) and \
                    not hasattr(method, "_accelerate_is_purged_environment_wrapped"):
                setattr(cls, name, wrap(method))
        return cls

    wrap_tests(func_or_cls)
    func_or_cls.__init_subclass__ = classmethod(lambda cls, **kw: wrap_tests(cls))
    return func_or_cls
