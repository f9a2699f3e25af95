# accelerate_c/as_accelerate.py: the switch that makes `import accelerate` (the package and every submodule path)
# resolve to accelerate_c, for code we do not own (transformers' Trainer, PEFT, TRL). One sys.meta_path finder,
# first in the list, answers every name under `accelerate`: `accelerate.X.Y` is the module `accelerate_c.X.Y`
# itself (the same object, faces included), a name we do not provide is a ModuleNotFoundError naming it (never HF's
# installed package, never a mix), and the same finder answers importlib.metadata for the distribution
# "accelerate" (version HF_VERSION, the HF Accelerate release whose API we follow), so version checks pass.
# Three ways in, one mechanism: install_as_accelerate() in-process, ACCELERATE_C_AS_ACCELERATE=1 in the
# environment (the accelerate_c_as_accelerate.pth file installed with the package calls install_from_env() at
# interpreter start-up, only when the variable is set), and `python -m accelerate_c launch --as_accelerate`.
# Not for: anything else; it imports nothing heavy (accelerate_c itself resolves its names lazily).
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import os
import re
import sys
import types
from typing import Any, Iterator, Optional

from .base import settings

HF_NAME = "accelerate"
HF_VERSION = "1.15.0"
OURS = "accelerate_c"
PTH_FILE = "accelerate_c_as_accelerate.pth"


def _target(fullname: str) -> str:
    return OURS + fullname[len(HF_NAME):]


class _Alias(types.ModuleType):
    """`accelerate` itself: every attribute read and write goes to accelerate_c (so monkeypatching reaches the
    real code), except the version, which is HF_VERSION for the version checks of the code we do not own."""

    def __getattr__(self, name: str) -> Any:
        return getattr(sys.modules[OURS], name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name.startswith("__") and name.endswith("__"):
            super().__setattr__(name, value)
        else:
            setattr(sys.modules[OURS], name, value)

    def __delattr__(self, name: str) -> None:
        delattr(sys.modules[OURS], name)

    def __dir__(self) -> list:
        return sorted(set(dir(sys.modules[OURS])) | {"__version__"})


class _Loader(importlib.abc.Loader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        if spec.name == HF_NAME:
            ours = importlib.import_module(OURS)
            alias = _Alias(HF_NAME, ours.__doc__)
            for key in ("__file__", "__path__", "__all__"):
                if hasattr(ours, key):
                    object.__setattr__(alias, key, getattr(ours, key))
            object.__setattr__(alias, "__version__", HF_VERSION)
            return alias
        # the real module object: `accelerate.utils.operations is accelerate_c.utils.operations` (a face resolves
        # to the module it names), so private names and monkeypatching reach the code
        return importlib.import_module(_target(spec.name))

    def exec_module(self, module: types.ModuleType) -> None:
        return None  # create_module returned a module that is already executed


class _Metadata(importlib.metadata.Distribution):
    """The distribution "accelerate" as version checks see it under the switch."""

    def read_text(self, filename: str) -> Optional[str]:
        if filename == "METADATA":
            return (f"Metadata-Version: 2.1\nName: {HF_NAME}\nVersion: {HF_VERSION}\n"
                    f"Summary: accelerate_c standing in for HF Accelerate {HF_VERSION}\n")
        if filename == "top_level.txt":
            return HF_NAME + "\n"
        return None

    def locate_file(self, path: Any) -> Any:
        import pathlib

        return pathlib.Path(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) / path


class AccelerateFinder(importlib.abc.MetaPathFinder):
    """First on sys.meta_path while the switch is on: owns every module name under `accelerate`."""

    _loader = _Loader()

    def find_spec(self, fullname: str, path: Any = None,
                  target: Any = None) -> Optional[importlib.machinery.ModuleSpec]:
        if fullname != HF_NAME and not fullname.startswith(HF_NAME + "."):
            return None
        ours = _target(fullname)
        loaded = sys.modules.get(ours)
        if loaded is not None:
            is_pkg, origin = hasattr(loaded, "__path__"), getattr(loaded, "__file__", None)
            return self._spec(fullname, origin, list(loaded.__path__) if is_pkg else None)
        try:
            spec = importlib.util.find_spec(ours)
        except ModuleNotFoundError:
            spec = None
        if spec is None:
            raise ModuleNotFoundError(
                f"No module named {fullname!r}: accelerate_c stands in for `accelerate` "
                f"(ACCELERATE_C_AS_ACCELERATE / install_as_accelerate) and has no module {ours!r}; HF Accelerate's "
                "own package is never imported while the switch is on", name=fullname)
        locations = spec.submodule_search_locations
        return self._spec(fullname, spec.origin, None if locations is None else list(locations))

    def _spec(self, fullname: str, origin: Optional[str], locations: Optional[list]) -> importlib.machinery.ModuleSpec:
        out = importlib.machinery.ModuleSpec(fullname, self._loader, origin=origin, is_package=locations is not None)
        if locations is not None:
            out.submodule_search_locations = locations
        out.has_location = origin is not None
        return out

    def find_distributions(self, context: Any = importlib.metadata.DistributionFinder.Context()) -> Iterator[Any]:
        name = getattr(context, "name", None)
        if name is None or re.sub(r"[-_.]+", "_", name).lower() == HF_NAME:
            yield _Metadata()


def _finder() -> Optional[AccelerateFinder]:
    return next((f for f in sys.meta_path if isinstance(f, AccelerateFinder)), None)


def is_installed() -> bool:
    """Whether the switch is on in this process."""
    return _finder() is not None


def install_as_accelerate() -> None:
    """Every later `import accelerate...` resolves to accelerate_c (idempotent). Call it before anything imports
    `accelerate`: when HF's package (or any module under it) is already imported this raises ImportError naming
    those modules, rather than leave the process with a mix of the two."""
    if is_installed():
        return
    already = sorted(n for n, m in sys.modules.items()
                     if (n == HF_NAME or n.startswith(HF_NAME + ".")) and m is not None
                     and not (getattr(m, "__name__", "") or "").startswith(OURS) and not isinstance(m, _Alias))
    if already:
        shown = ", ".join(already[:5]) + (f" and {len(already) - 5} more" if len(already) > 5 else "")
        where = getattr(sys.modules.get(already[0]), "__file__", None)
        raise ImportError(f"install_as_accelerate(): HF Accelerate is already imported in this process ({shown}; "
                          f"from {where}); call it (or set ACCELERATE_C_AS_ACCELERATE=1) before anything imports "
                          "accelerate")
    sys.meta_path.insert(0, AccelerateFinder())
    importlib.invalidate_caches()


def uninstall_as_accelerate() -> None:
    """Turns the switch off and forgets the `accelerate` modules it served (for tests)."""
    finder = _finder()
    while finder is not None:
        sys.meta_path.remove(finder)
        finder = _finder()
    for n in [n for n in sys.modules if n == HF_NAME or n.startswith(HF_NAME + ".")]:
        m = sys.modules[n]
        if isinstance(m, _Alias) or (getattr(m, "__name__", "") or "").startswith(OURS):
            del sys.modules[n]


def hook_path() -> Optional[str]:
    """The installed start-up hook (the .pth file in a site-packages folder), or None (running from a checkout)."""
    import site

    dirs = list(getattr(site, "getsitepackages", lambda: [])()) + [getattr(site, "getusersitepackages", lambda: "")()]
    return next((os.path.join(d, PTH_FILE) for d in dirs if d and os.path.isfile(os.path.join(d, PTH_FILE))), None)


def describe() -> str:
    """One line for `python -m accelerate_c env`: whether the switch is on, and where its hook is."""
    try:
        wanted = settings.get("AS_ACCELERATE")
    except settings.SettingError as exc:
        return f"no ({exc})"
    hook = hook_path()
    state = "yes" if (wanted or is_installed()) else "no"
    how = f" (ACCELERATE_C_AS_ACCELERATE={'1' if wanted else 'unset or 0'}, reports version {HF_VERSION})"
    return state + how + (f"; start-up hook {hook}" if hook else "; start-up hook not installed (source checkout)")


def install_from_env() -> bool:
    """ACCELERATE_C_AS_ACCELERATE (settings table): install the switch when true; returns whether it is on."""
    if settings.get("AS_ACCELERATE"):
        install_as_accelerate()
    return is_installed()


class _Refuser(importlib.abc.MetaPathFinder):
    """Left by startup() when the switch could not be read or turned on: every `import accelerate...` fails with
    that reason (the script must not run on HF's package when the user asked for ours)."""

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> None:
        if fullname == HF_NAME or fullname.startswith(HF_NAME + "."):
            raise ImportError(f"cannot import {fullname!r}: {self.reason}", name=fullname)
        return None


def startup() -> None:
    """The .pth hook's call at interpreter start-up (only when ACCELERATE_C_AS_ACCELERATE is set): a bad value
    or a failure is reported once on stderr and then by every `import accelerate`, never silently ignored.
    Idempotent: some set-ups read site-packages' .pth files twice."""
    if any(isinstance(f, _Refuser) for f in sys.meta_path):
        return
    try:
        install_from_env()
    except Exception as exc:  # noqa: BLE001 - site.py would print a traceback and go on without the switch
        reason = f"ACCELERATE_C_AS_ACCELERATE could not be applied: {type(exc).__name__}: {exc}"
        print(f"accelerate_c: {reason}", file=sys.stderr)
        sys.meta_path.insert(0, _Refuser(reason))
