# accelerate_c/runtime/progress.py: HF's `tqdm` wrapper: a tqdm.auto progress bar shown only on each machine's
# local main process by default (`main_process_only=True`), with HF's argument checks.
# Not for: logging (accelerate_c.runtime.logging).
from __future__ import annotations

from typing import Any

from ..base.imports import is_tqdm_available


def tqdm(*args: Any, main_process_only: bool = True, **kwargs: Any) -> Any:
    """tqdm.auto.tqdm(*args, **kwargs), disabled on every process but the local main one unless
    `main_process_only=False` (an explicit `disable=True` always wins)."""
    if not is_tqdm_available():
        raise ImportError("Accelerate's `tqdm` module requires `tqdm` to be installed. Please run `pip install tqdm`.")
    if args and isinstance(args[0], bool):
        raise ValueError("Passing `True` or `False` as the first argument to Accelerate's `tqdm` wrapper is "
                         "unsupported. Please use the `main_process_only` keyword argument instead.")
    from tqdm.auto import tqdm as _tqdm

    from .state import PartialState

    disable = kwargs.pop("disable", False)
    if main_process_only and not disable:
        disable = PartialState().local_process_index != 0
    return _tqdm(*args, **kwargs, disable=disable)
