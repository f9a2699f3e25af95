# Command-line options derived from ClusterConfig's field metadata: one option per field with a `flag`
# (plus its aliases and the switch flags that store a fixed value, e.g. --multi_gpu), one per field of
# a nested block (--fp8_*, --dynamo_*), each also under its hyphenated spelling as HF accepts
# (--num-processes); merging the given flags over a config; a help formatter that lists HF's underscore
# spellings only. Not for: the keys and their validation (config_args.py) or the commands themselves.
from __future__ import annotations

import argparse
import copy
import dataclasses
from typing import Any

from .config_args import BLOCKS, ClusterConfig
from .config_values import ARG_TYPES


def spellings(flag: str) -> list[str]:
    """'--num_processes' -> ['--num_processes', '--num-processes'] (HF accepts both)."""
    hyphenated = flag[:2] + flag[2:].replace("_", "-")
    return [flag] if hyphenated == flag or not flag.startswith("--") else [flag, hyphenated]


def add_flag(parser: Any, flag: str, *aliases: str, **kw: Any) -> argparse.Action:
    """parser.add_argument under the flag's spellings (and aliases such as '-q')."""
    return parser.add_argument(*spellings(flag), *aliases, **kw)


class HelpFormatter(argparse.HelpFormatter):
    """Shows each option under its underscore spelling only (the hyphenated twin works but is not listed)."""

    def _format_action_invocation(self, action: argparse.Action) -> str:
        shown = [s for s in action.option_strings if not (s.startswith("--") and "-" in s[2:])]
        if action.option_strings and len(shown) < len(action.option_strings):
            action = copy.copy(action)
            action.option_strings = shown
        return super()._format_action_invocation(action)


def _value_kw(meta: Any, name: str, valued_bools: bool = False) -> dict[str, Any]:
    """add_argument keywords for one field: a const True for booleans (absent = None, so the config file
    fills it) or, for blocks whose HF flags take one (`--fsdp_offload_params true`), a true/false value; else a
    typed value (normalised first when the field has `norm`)."""
    if meta["kind"] == "bool":
        if valued_bools:
            return dict(type=_bool_arg, metavar="true|false")
        return dict(action="store_const", const=True)
    kind_type = ARG_TYPES[meta["kind"]]
    norm = meta["norm"]
    return dict(type=(lambda text: norm(kind_type(text))) if norm else kind_type, choices=meta["choices"],
                metavar=None if meta["choices"] else name.upper())


def add_config_flags(parser: Any) -> None:
    """Add the options of every flagged ClusterConfig field and block field. Defaults are None so that
    `apply_flags` can tell a given flag from an absent one (config file values fill the rest)."""
    for f in dataclasses.fields(ClusterConfig):
        meta = f.metadata
        if meta["flag"]:
            add_flag(parser, meta["flag"], *meta["aliases"], dest=f.name, default=None, help=meta["help"],
                     **_value_kw(meta, f.name))
        for switch, (value, text) in meta["switches"].items():
            add_flag(parser, switch, dest=f.name, action="store_const", const=value, default=None,
                     help=f"{text} ({f.name} {value})")
    for key, block in BLOCKS.items():
        for f in dataclasses.fields(block):
            if f.metadata["kind"] in ("list", "dict") or f.name in getattr(block, "FILE_ONLY", ()):
                continue  # only in the file (fp8 override_linear_precision; DeepSpeed's GA/clipping: top-level flags)
            add_flag(parser, block.flag_of(f.name), dest=block.dest_of(f.name), default=None,
                     help=f"{key}: {f.metadata['help']}",
                     **_value_kw(f.metadata, f.name.removeprefix(block.PREFIX), getattr(block, "VALUED_BOOLS", False)))


def _bool_arg(text: str) -> bool:
    from .config_values import _parse_bool
    try:
        return _parse_bool(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: allowed: true or false") from None


def apply_flags(cfg: ClusterConfig, args: Any) -> ClusterConfig:
    """A copy of `cfg` with every flag that was given on the command line put over it (flags win)."""
    updates: dict[str, Any] = {f.name: getattr(args, f.name) for f in dataclasses.fields(ClusterConfig)
                               if (f.metadata["flag"] or f.metadata["switches"])
                               and getattr(args, f.name, None) is not None}
    for key, block in BLOCKS.items():
        given = {f.name: getattr(args, block.dest_of(f.name)) for f in dataclasses.fields(block)
                 if getattr(args, block.dest_of(f.name), None) is not None}
        if given:
            merged = {block.key_of(k): v for k, v in getattr(cfg, key).items()}
            merged.update(given)
            updates[key] = {block.file_key(k): v for k, v in merged.items()}
    return dataclasses.replace(cfg, **updates)
