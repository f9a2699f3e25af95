# The value rules of a config file's keys, below ClusterConfig (config_args.py): ConfigError, the bounds of the
# launch values, turning one key's value into its field's kind within its bounds or a ConfigError naming the key,
# the value and what is allowed (`_check`), building a dataclass from a mapping (`_build`: unknown keys named, with
# the nearest known ones), typed answers of the interactive `config`, and --rdzv_conf's items with the values torch
# reads checked (RDZV_RULES).
# Not for: the keys themselves (config_args.py), reading files (yaml_safe.py) or the launch-time checks
# (config_bounds.py).
from __future__ import annotations

import dataclasses
import difflib
import math
from typing import Any

# Bounds of the launch values (docs/launching.md, "Bounds of the launch values").
MAX_PROCESSES = 1 << 20     # num_processes, over all machines
MAX_MACHINES = 1 << 16      # num_machines
MAX_THREADS = 1 << 16       # num_cpu_threads_per_process
MAX_RESTARTS = 10_000       # max_restarts
OVERSUBSCRIBE_FACTOR = 16   # local processes x threads per process <= this x the cores (config_bounds.py)


# the quoted words HF's `accelerate config` wrote for booleans over the years (`downcast_bf16: 'no'`), read as HF
# means them (its str_to_bool words)
BOOL_WORDS = {**dict.fromkeys(("yes", "true", "y", "t", "on", "1"), True),
              **dict.fromkeys(("no", "false", "n", "f", "off", "0"), False)}


class ConfigError(ValueError):
    """A bad config key or value; the message names the key and what is allowed."""


def _default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default is dataclasses.MISSING else f.default  # type: ignore[misc]


def _allowed(f: dataclasses.Field) -> str:
    meta = f.metadata
    if meta["choices"]:
        return "one of " + ", ".join(repr(c) for c in meta["choices"])
    kind = {"int": "an integer", "float": "a finite number", "str": "a string",
            "bool": "true or false (or 'yes' / 'no')",
            "dict": "a mapping", "list": "a list", "scalar": "a string, number or boolean"}[meta["kind"]]
    low, high = meta.get("bounds") or (None, None)
    if low is not None and high is not None:
        kind += f" in {low:_}..{high:_}"
    elif low is not None:
        kind += f" >= {low:_}"
    elif high is not None:
        kind += f" <= {high:_}"
    return kind + (" or null" if _default(f) is None else "")


def _in_bounds(f: dataclasses.Field, value: Any) -> bool:
    """An int/float field's value within its `bounds` (and, for a float, finite: no NaN or infinity)."""
    if f.metadata["kind"] == "float" and not math.isfinite(value):
        return False
    low, high = f.metadata.get("bounds") or (None, None)
    return (low is None or value >= low) and (high is None or value <= high)


def _check(f: dataclasses.Field, value: Any, prefix: str = "") -> Any:
    """Return `value` converted to the field's kind, or raise ConfigError naming key and allowed values."""
    kind, choices = f.metadata["kind"], f.metadata["choices"]
    if f.metadata["norm"] and isinstance(value, str):
        value = f.metadata["norm"](value)
    if value is None:  # HF's writers leave `key: null` for what was not asked: the key's default, as HF reads it
        return _default(f)
    ok = False
    if kind == "bool":
        if isinstance(value, str) and value.strip().lower() in BOOL_WORDS:  # HF's questionnaire wrote 'no' / 'yes'
            value = BOOL_WORDS[value.strip().lower()]
        ok = isinstance(value, bool)
    elif kind == "int":
        ok = isinstance(value, int) and not isinstance(value, bool) and (not choices or value in choices)
    elif kind == "scalar":  # a name or a boolean/number (fsdp_reshard_after_forward: true | FULL_SHARD)
        ok = isinstance(value, (str, bool, int, float))
    elif kind == "float":
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        try:
            value = float(value) if ok else value
        except OverflowError:  # an integer beyond any float
            ok = False
    elif kind == "str":
        if value is False and choices:  # YAML 1.1 reads an unquoted `no`/`NO` as false
            value = next((c for c in choices if c.lower() == "no"), value)
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and not choices:
            value = str(value)  # e.g. `gpu_ids: 0`
        ok = isinstance(value, str) and (not choices or value in choices)
    elif kind == "dict":
        ok = isinstance(value, dict)
    elif kind == "list":
        ok = isinstance(value, (list, tuple))
        value = list(value) if ok else value
    if ok and kind in ("int", "float"):
        ok = _in_bounds(f, value)
    if not ok:
        raise ConfigError(f"config key `{prefix}{f.name}`: got {_shown(value)}; allowed: {_allowed(f)}")
    return value


def _shown(value: Any, limit: int = 200) -> str:
    """repr(value), cut to `limit` characters (a bad value may be a whole mapping, or a 4000-digit integer)."""
    try:
        text = repr(value)
    except ValueError:  # an int too long for repr (sys.int_info.default_max_str_digits)
        return f"an integer of about {value.bit_length() * 30103 // 100000 + 1} digits"
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} characters)"


def _build(cls: type, data: dict[str, Any], prefix: str = "") -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"config{' ' + prefix if prefix else ''} must be a mapping of keys to values, "
                          f"got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        near = [m for k in unknown for m in difflib.get_close_matches(k, fields, n=1)]
        hint = f" (did you mean {', '.join(prefix + m for m in near)}?)" if near else ""
        raise ConfigError(f"unknown config key(s) {', '.join(prefix + k for k in unknown)}{hint}; allowed keys: "
                          f"{', '.join(prefix + k for k in fields)}")
    obj = cls.__new__(cls)
    for name, f in fields.items():
        object.__setattr__(obj, name, _check(f, data[name], prefix) if name in data else _default(f))
    return obj


def _parse_bool(text: str) -> bool:
    low = text.strip().lower()
    if low in ("1", "true", "yes", "y", "on"):
        return True
    if low in ("0", "false", "no", "n", "off"):
        return False
    raise ValueError(f"not a boolean: {text!r}")


ARG_TYPES = {"int": int, "float": float, "str": str, "scalar": str}  # a field's kind -> the type of its flag's value


def parse_answer(f: dataclasses.Field, text: str) -> Any:
    """Turn a typed answer into the field's kind (for the interactive `config`); ConfigError if bad."""
    kind = f.metadata["kind"]
    try:
        value: Any = _parse_bool(text) if kind == "bool" else ARG_TYPES[kind](text.strip())
    except (ValueError, KeyError):
        raise ConfigError(f"config key `{f.name}`: got {text!r}; allowed: {_allowed(f)}") from None
    return _check(f, value)


# The rendezvous settings torch reads (its handlers cast them when the launch starts; a bad one was a traceback
# from inside torch) -> (low, high) of an integer, or the allowed words. Other keys pass through unchecked.
RDZV_MAX_SECONDS = 7 * 24 * 3600
RDZV_RULES: dict[str, Any] = {
    **{k: (1, RDZV_MAX_SECONDS) for k in ("join_timeout", "last_call_timeout", "close_timeout", "heartbeat_timeout",
                                          "timeout", "read_timeout", "keep_alive_interval")},
    "keep_alive_max_attempt": (1, 1000),
    "rank": (0, MAX_MACHINES - 1),
    "is_host": ("1", "true", "t", "yes", "y", "0", "false", "f", "no", "n"),  # torch's get_as_bool words
    "store_type": ("tcp", "file"),
}


def _rdzv_value(key: str, value: str, text: str) -> str:
    rule = RDZV_RULES.get(key)
    if rule is None:
        return value
    if isinstance(rule[0], str):  # words (any case, as torch reads them)
        if value.lower() in rule:
            return value
        allowed = "one of " + ", ".join(rule)
    else:
        low, high = rule
        try:
            if low <= int(value) <= high:
                return str(int(value))
        except ValueError:
            pass
        allowed = f"an integer in {low:_}..{high:_}" + (" (seconds)" if high == RDZV_MAX_SECONDS else "")
    raise ConfigError(f"config key `rdzv_conf`: {key}={value!r} (in {_shown(text)}); allowed: {allowed}")


def parse_rdzv_conf(text: str | None) -> dict[str, str]:
    """'k=v,k2=v2' -> {'k': 'v', 'k2': 'v2'} (torch's --rdzv_conf form); ConfigError naming a bad item, or a bad
    value of a setting torch reads (RDZV_RULES: join_timeout=abc, timeout=-1, is_host=maybe)."""
    out: dict[str, str] = {}
    for item in (text or "").split(","):
        if not item.strip():
            continue
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"config key `rdzv_conf`: bad item {item!r} in {_shown(text)}; allowed: "
                              "'key=value' items separated by commas")
        out[key.strip()] = _rdzv_value(key.strip(), value.strip(), text or "")
    return out
