# Reading a config file (YAML or JSON) that someone else may have written, within bounds: at most MAX_BYTES
# read, a regular file only (a FIFO would block the reader), nesting at most MAX_DEPTH deep, and YAML aliases
# allowed only while the document they expand to stays small (MAX_NODES nodes, MAX_CHARS characters of
# scalars, counted with every alias expanded), so a few hundred bytes of nested aliases (an "alias bomb")
# are a named error in milliseconds instead of gigabytes of JSON in the ranks' environment. HF's `accelerate
# config` writes neither aliases nor more than three levels; the limits are far above any real config.
# Not for: what the keys mean (config_args.py).
from __future__ import annotations

import json
import os
import stat
from typing import Any

import yaml

MAX_BYTES = 1 << 20   # a config file (HF's are under 2 KB)
MAX_DEPTH = 32        # nested mappings / lists
MAX_NODES = 10_000    # YAML nodes with every alias expanded
MAX_CHARS = 1 << 20   # characters of all scalars with every alias expanded
MAX_INT_DIGITS = 100  # a YAML integer


class LimitError(ValueError):
    """A file over one of the limits above; the message names the limit and its value."""


def read_text(path: str, what: str = "config file") -> str:
    """The file's text: a regular file of at most MAX_BYTES bytes (LimitError otherwise)."""
    with open(path, "rb", opener=_nonblocking) as fh:
        if not stat.S_ISREG(os.fstat(fh.fileno()).st_mode):
            raise LimitError(f"{what} {path}: not a regular file")
        data = fh.read(MAX_BYTES + 1)
    if len(data) > MAX_BYTES:
        raise LimitError(f"{what} {path}: larger than {MAX_BYTES:_} bytes; allowed: at most {MAX_BYTES:_} bytes")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise LimitError(f"{what} {path}: not UTF-8 text ({exc})") from None


def _nonblocking(path: str, flags: int) -> int:
    # O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer (the check above then refuses it)
    return os.open(path, flags | getattr(os, "O_NONBLOCK", 0))


def check_depth(data: Any, where: str) -> None:
    """LimitError when `data` (parsed JSON/YAML) nests deeper than MAX_DEPTH (walked without recursion)."""
    stack = [(data, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, (dict, list)):
            if depth > MAX_DEPTH:
                raise LimitError(f"{where}: nested more than {MAX_DEPTH} levels deep; allowed: at most {MAX_DEPTH}")
            stack.extend((v, depth + 1) for v in (value.values() if isinstance(value, dict) else value))


def load_json(text: str, where: str) -> Any:
    """json.loads within MAX_DEPTH (json.JSONDecodeError for bad JSON, LimitError for a bound)."""
    try:
        data = json.loads(text)
    except RecursionError:
        raise LimitError(f"{where}: nested more than {MAX_DEPTH} levels deep; allowed: at most {MAX_DEPTH}") from None
    except json.JSONDecodeError:
        raise
    except ValueError as exc:  # an integer of more than sys.get_int_max_str_digits() digits
        raise LimitError(f"{where}: {exc}") from None
    check_depth(data, where)
    return data


def load_yaml(text: str, where: str) -> Any:
    """yaml.safe_load's result, within the limits above (yaml.YAMLError for bad YAML, LimitError for a bound)."""
    loader = BoundedLoader(text, where)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


class BoundedLoader(yaml.SafeLoader):  # (its constructors: SafeLoader's, construct_yaml_int bounded below)
    """SafeLoader that counts, while it composes, the size the document has with its aliases expanded. Every
    node's expanded size (nodes, scalar characters, height) is known once it is composed, so an alias adds its
    anchor's size at once: the count is exact and costs one addition per alias. An alias to a node still being
    composed (a recursive structure) is refused too."""

    def __init__(self, stream: str, where: str) -> None:
        super().__init__(stream)
        self._where = where
        self._depth = 0
        self._nodes = 0
        self._chars = 0
        self._aliases = 0
        self._sizes: dict[int, tuple[int, int, int]] = {}  # id(node) -> (nodes, chars, height) expanded

    def _fail(self, what: str, mark: Any) -> LimitError:
        at = f" (line {mark.line + 1})" if mark is not None else ""
        return LimitError(f"{self._where}: {what}{at}")

    def _count(self, nodes: int, chars: int, height: int, mark: Any) -> None:
        self._nodes += nodes
        self._chars += chars
        for count, limit, unit in ((self._nodes, MAX_NODES, "nodes"), (self._chars, MAX_CHARS, "characters")):
            if count > limit and self._aliases:
                raise self._fail(f"YAML alias expansion: the document grows past {limit:_} {unit} once its "
                                 f"{self._aliases} alias(es) (*name) are expanded; allowed: at most {limit:_} {unit} "
                                 "(an alias bomb?)", mark)
            if count > limit:
                raise self._fail(f"more than {limit:_} {unit}; allowed: at most {limit:_} {unit}", mark)
        if self._depth + height > MAX_DEPTH:
            raise self._fail(f"nested more than {MAX_DEPTH} levels deep (aliases expanded); allowed: at most "
                             f"{MAX_DEPTH}", mark)

    def construct_yaml_int(self, node: Any) -> Any:
        digits = sum(c.isdigit() for c in str(node.value))
        if digits > MAX_INT_DIGITS:  # (int() of thousands of digits is refused by Python, or slow)
            raise self._fail(f"an integer of {digits:_} digits; allowed: at most {MAX_INT_DIGITS} digits",
                             node.start_mark)
        return super().construct_yaml_int(node)

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            node = self.anchors.get(event.anchor)
            if node is not None:  # (an undefined alias: the composer's own error)
                size = self._sizes.get(id(node))
                if size is None:
                    raise self._fail(f"alias *{event.anchor} refers to a node that contains it (a recursive "
                                     "structure); allowed: aliases to complete nodes", event.start_mark)
                self._aliases += 1
                self._count(*size, event.start_mark)
            return super().compose_node(parent, index)
        mark = self.peek_event().start_mark
        self._depth += 1
        if self._depth > MAX_DEPTH:
            raise self._fail(f"nested more than {MAX_DEPTH} levels deep; allowed: at most {MAX_DEPTH}", mark)
        nodes, chars = self._nodes, self._chars
        try:
            node = super().compose_node(parent, index)
        finally:
            self._depth -= 1
        scalar = len(node.value) if isinstance(node, yaml.ScalarNode) else 0
        self._count(1, scalar, 0, mark)
        # this node's expanded size: what was counted while composing it (children, aliases) plus itself
        height = self._height_of(node)
        self._sizes[id(node)] = (self._nodes - nodes, self._chars - chars, height)
        return node

    def _height_of(self, node: Any) -> int:
        """Levels of `node` (a scalar is one), its aliases expanded (its children's heights are known already)."""
        if isinstance(node, yaml.ScalarNode):
            return 1
        children = node.value if isinstance(node, yaml.SequenceNode) else [v for kv in node.value for v in kv]
        return 1 + max((self._sizes.get(id(c), (0, 0, 1))[2] for c in children), default=0)


BoundedLoader.add_constructor("tag:yaml.org,2002:int", BoundedLoader.construct_yaml_int)
