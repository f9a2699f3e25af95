# The field declaration helper (`setting`: a dataclass field whose metadata says how the key is typed,
# checked, flagged and exported) and the nested config blocks that have fields of their own
# (fp8_config, dynamo_config), shared by ClusterConfig in config_args.py.
# Not for: validation, file I/O or the CLI (config_args.py, config_flags.py).
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable

from ..base.dataclasses import DynamoBackend

TORCH_DYNAMO_MODES = ("default", "reduce-overhead", "max-autotune")  # HF's choices


def env_str(value: Any) -> str:
    """A value as the ranks' environment carries it (booleans as true/false)."""
    return ("true" if value else "false") if isinstance(value, bool) else str(value)


def setting(default: Any, kind: str, help: str, *, choices: tuple | None = None, env: str | None = None,
            flag: str | None = None, ext: bool = False, question: str | None = None, aliases: tuple = (),
            switches: dict | None = None, norm: Callable[[str], str] | None = None,
            bounds: tuple | None = None) -> Any:
    """One setting. kind: int|float|str|bool|dict|list; flag: the `launch` option (None = no flag; its
    hyphenated spelling is accepted too); aliases: more option strings (e.g. '-t'); switches: flags that
    store a fixed value ({'--multi_gpu': ('MULTI_GPU', help)}); env: the variable the ranks receive; ext: an
    accelerate_c key, written only when not default; question: asked by the interactive `config`;
    norm: applied to a string value before it is checked (e.g. str.upper); bounds: (low, high) of an int or
    float, inclusive, either None for unbounded (every float must be finite, bounded or not)."""
    meta = dict(kind=kind, help=help, choices=choices, env=env, flag=flag, ext=ext, question=question,
                aliases=aliases, switches=switches or {}, norm=norm, bounds=bounds)
    if isinstance(default, (dict, list)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


class _Block:
    """A nested `<name>_config` mapping with fields of its own. Each field has a `launch --<PREFIX><key>`
    flag, an ACCELERATE_<PREFIX><KEY> variable (HF's names) and accepts the key with or without the
    prefix in a file; FILE_PREFIX says which spelling is written (the one HF's `config` writes)."""
    PREFIX = ""
    FILE_PREFIX = False
    LEGACY: dict[str, str] = {}  # keys older HF writers used -> the field that means the same now

    @classmethod
    def key_of(cls, name: str) -> str:
        """Canonical field name for a file key ('fp8_margin' -> 'margin'; 'fp8_format' stays)."""
        name = cls.LEGACY.get(name, name)
        names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        if name not in names and name.startswith(cls.PREFIX) and name[len(cls.PREFIX):] in names:
            return name[len(cls.PREFIX):]
        return name

    @classmethod
    def file_key(cls, name: str) -> str:
        return cls.PREFIX + name if cls.FILE_PREFIX and not name.startswith(cls.PREFIX) else name

    @classmethod
    def flag_of(cls, name: str) -> str:
        return "--" + cls.PREFIX + name.removeprefix(cls.PREFIX)

    @classmethod
    def env_of(cls, name: str) -> str:
        return "ACCELERATE_" + (cls.PREFIX + name.removeprefix(cls.PREFIX)).upper()

    @classmethod
    def dest_of(cls, name: str) -> str:
        """argparse dest of the field's flag ('fp8__margin'), apart from ClusterConfig's own dests."""
        return cls.PREFIX + "_" + name

    def env(self) -> dict[str, str]:
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}  # type: ignore[arg-type]
        return {self.env_of(k): env_str(v) for k, v in values.items() if v is not None}


@dataclass
class FP8Config(_Block):
    """The `fp8_config` block. Keys are HF's; `fp8_`-prefixed spellings are accepted too."""
    PREFIX = "fp8_"
    backend: str | None = setting(None, "str", "FP8 backend (HF: TE|MSAMP|AO); accelerate_c uses its own",
                                  choices=("TE", "MSAMP", "AO", "te", "msamp", "ao"))
    fp8_format: str = setting("HYBRID", "str", "FP8 recipe format", choices=("E4M3", "HYBRID", "E5M2"))
    amax_history_len: int = setting(1024, "int", "length of the amax history for scaling", bounds=(1, 1_000_000))
    amax_compute_algo: str = setting("most_recent", "str", "how the scale is derived from the amax history",
                                     choices=("max", "most_recent"))
    margin: int = setting(0, "int", "margin (power of two) for the fp8 scale", bounds=(-64, 64))
    interval: int = setting(1, "int", "how often (steps) the scale is recomputed", bounds=(1, None))
    override_linear_precision: Any = setting(None, "list", "(fprop, dgrad, wgrad) in higher precision")
    use_autocast_during_eval: bool = setting(False, "bool", "keep fp8 autocast during eval")
    opt_level: str | None = setting(None, "str", "MS-AMP optimisation level", choices=("O1", "O2"))
    enable_fsdp_float8_all_gather: bool = setting(False, "bool", "fp8 all-gather for FSDP2 (torchao)")
    pad_inner_dim: bool = setting(False, "bool", "pad inner dims of fp8 GEMMs (torchao)")

    def env(self) -> dict[str, str]:
        out = super().env()
        if out.pop(self.env_of("override_linear_precision"), None) is not None:  # HF: one variable per part
            for part, v in zip(("FPROP", "DGRAD", "WGRAD"), self.override_linear_precision):
                out["ACCELERATE_FP8_OVERRIDE_" + part] = env_str(v)
        return out


@dataclass
class DynamoConfig(_Block):
    """The `dynamo_config` block (torch.compile). HF writes the keys `dynamo_`-prefixed; both spellings
    are read. The ranks always get HF's ACCELERATE_DYNAMO_* variables (backend NO = no compile)."""
    PREFIX = "dynamo_"
    FILE_PREFIX = True
    backend: str = setting("NO", "str", "torch.compile backend (HF's names, any case; NO = do not compile)",
                           choices=tuple(b.value for b in DynamoBackend), norm=str.upper)
    mode: str = setting("default", "str", "torch.compile mode", choices=TORCH_DYNAMO_MODES)
    use_fullgraph: bool = setting(False, "bool", "compile the whole model as one graph (no graph breaks)")
    use_dynamic: bool = setting(False, "bool", "trace with dynamic shapes")
    use_regional_compilation: bool = setting(False, "bool", "compile repeated blocks once (regional compilation)")


BLOCKS: dict[str, type[_Block]] = {"fp8_config": FP8Config, "dynamo_config": DynamoConfig}
