# tests/test_layers.py: the package's layers, read from its imports. Every import of our own modules counts,
# module-level or inside a function (a lazy import that only hides a loop is still a loop): no module may import
# one of a higher layer, no two modules may import each other through any chain, and no two packages either.
# The table below is the one in docs/architecture.md; a package or top-level module missing from it fails.
from __future__ import annotations

import ast
import pathlib

import pytest

PKG = pathlib.Path(__file__).resolve().parent.parent / "accelerate_c"

# top to bottom; a module may import its own layer's packages or lower ones
LAYERS = [
    ("facade", ["accelerate_c", "accelerate_c.__main__", "accelerate_c.accelerator", "accelerate_c.facade",
                "accelerate_c.launchers", "accelerate_c.commands", "accelerate_c.optimizer", "accelerate_c.scheduler",
                "accelerate_c.data_loader", "accelerate_c.utils", "accelerate_c.state", "accelerate_c.logging",
                "accelerate_c.ops", "accelerate_c.parallelism_config", "accelerate_c.big_modeling",
                "accelerate_c.hooks", "accelerate_c.inference", "accelerate_c.local_sgd"]),
    ("strategies", ["accelerate_c.strategies"]),
    ("engines", ["accelerate_c.sharding", "accelerate_c.ddp", "accelerate_c.checkpointing", "accelerate_c.data",
                 "accelerate_c.tracking", "accelerate_c.tensor_parallel", "accelerate_c.pipeline",
                 "accelerate_c.bigmodel"]),
    ("precision", ["accelerate_c.precision"]),
    ("deepspeed", ["accelerate_c.deepspeed"]),
    ("runtime", ["accelerate_c.runtime"]),
    ("comm/kernels/optim", ["accelerate_c.comm", "accelerate_c.optim", "accelerate_c._C", "accelerate_c._C_cuda"]),
    ("base", ["accelerate_c.base"]),
]
# HF's import paths kept as faces (the module object of the real code): never imported from inside
FACES = {"accelerate_c.accelerator", "accelerate_c.state", "accelerate_c.logging", "accelerate_c.ops",
         "accelerate_c.utils", "accelerate_c.parallelism_config", "accelerate_c.big_modeling", "accelerate_c.hooks"}
# modules allowed at the top of the package besides HF's top-level names
HF_TOP = {"accelerator", "state", "optimizer", "scheduler", "data_loader", "logging", "launchers", "parallelism_config",
          "big_modeling", "hooks", "inference", "local_sgd"}
MAX_OTHER_TOP = 3


def _modules() -> dict[str, pathlib.Path]:
    mods = {}
    for path in PKG.rglob("*.py"):
        parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        mods[".".join(parts)] = path
    return mods


def _imports(name: str, path: pathlib.Path, mods: dict) -> set[str]:
    """Every module of ours this file imports, at any depth of the code."""
    is_pkg = path.name == "__init__.py"
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_pkg else name.split(".")[:-1]
                base = base[:len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in mods or a.name == "_C" else mod
                       for a in node.names]
        for t in targets:
            if t == "accelerate_c._C":
                out.add(t)
                continue
            while t and t not in mods:
                t = t.rpartition(".")[0]
            # importing a.b.c runs the packages a.b's __init__ first: those count too (not the root's, which
            # imports nothing until a name is asked for)
            while t.startswith("accelerate_c.") and t != name and not name.startswith(t + "."):
                out.add(t)
                t = t.rpartition(".")[0]
    return out


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {name: _imports(name, path, mods) for name, path in mods.items()}


def _owner(name: str) -> str:
    """The layer entry (package or top-level module) a module belongs to: the longest listed prefix."""
    best = ""
    for _, entries in LAYERS:
        for e in entries:
            if (name == e or name.startswith(e + ".")) and len(e) > len(best):
                best = e
    return best


def _rank(entry: str) -> int:
    return next(i for i, (_, entries) in enumerate(LAYERS) if entry in entries)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one member (iterative Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]; counter[0] += 1; stack.append(root); on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        x = stack.pop(); on.discard(x); comp.append(x)
                        if x == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
            elif w not in index:
                index[w] = low[w] = counter[0]; counter[0] += 1; stack.append(w); on.add(w)
                work.append((w, iter(sorted(graph.get(w, ())))))
            elif w in on:
                low[v] = min(low[v], index[w])
    return out


def test_every_module_has_a_layer():
    missing = sorted(n for n in _modules() if not _owner(n))
    assert not missing, f"modules outside every layer of LAYERS (and docs/architecture.md): {missing}"


def test_no_import_runs_upward():
    bad = []
    for name, deps in _graph().items():
        for d in deps:
            if _rank(_owner(d)) < _rank(_owner(name)):
                bad.append(f"{name} -> {d}")
    assert not bad, "imports from a lower layer to a higher one:\n" + "\n".join(sorted(bad))


def test_faces_are_not_imported_from_inside():
    bad = [f"{n} -> {d}" for n, deps in _graph().items() for d in deps
           if d in FACES and _owner(n) not in FACES and n not in FACES and _rank(_owner(n)) > 0]
    assert not bad, "internal modules importing an HF-path face instead of the real module:\n" + "\n".join(bad)


def test_no_import_loops_between_modules():
    loops = _cycles(_graph())
    assert not loops, f"import loops: {loops}"


def test_no_import_loops_between_packages():
    pkg_graph: dict[str, set[str]] = {}
    for name, deps in _graph().items():
        src = _owner(name)
        pkg_graph.setdefault(src, set()).update(_owner(d) for d in deps if _owner(d) != src)
    loops = _cycles(pkg_graph)
    assert not loops, f"packages importing each other: {loops}"


def test_few_modules_at_the_top():
    top = sorted(p.stem for p in PKG.glob("*.py") if p.stem != "__init__" and p.stem not in HF_TOP)
    assert len(top) <= MAX_OTHER_TOP, f"modules at the package's top besides HF's names: {top}"


@pytest.mark.parametrize("bad", ["upward", "loop"])
def test_the_checks_catch_what_they_name(bad):
    graph = {"accelerate_c.base.x": {"accelerate_c.strategies.y"}, "accelerate_c.strategies.y": set()}
    if bad == "upward":
        assert _rank(_owner("accelerate_c.strategies.y")) < _rank(_owner("accelerate_c.base.x"))
    else:
        graph["accelerate_c.strategies.y"] = {"accelerate_c.base.x"}
        assert _cycles(graph) == [["accelerate_c.base.x", "accelerate_c.strategies.y"]]
