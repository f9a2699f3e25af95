# tests/test_hf_names.py: every name the installed transformers, PEFT and TRL import from `accelerate` resolves under
# the switch (ACCELERATE_C_AS_ACCELERATE=1). The list is generated from their sources (every `from accelerate... import
# X`, `import accelerate...` and `accelerate.a.b` attribute chain, read with ast), never typed by hand; a fresh
# interpreter with the switch on imports each (and PEFT), and no file of HF's own package may have been imported.
# transformers' Trainer and TRL's trainers import accelerate.parallelism_config at module level: checked with it. ParallelismConfig arrives with the tensor-parallel branch: skipped, by
# name and with the reason, only while accelerate_c has no `parallelism_config` module.
# Not for: behaviour (test_bigmodel.py and the others compare with HF on the same input).
import ast
import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import pytest

from conftest import clean_env

import accelerate as hf_accelerate

HF_DIR = os.path.dirname(hf_accelerate.__file__)
PACKAGES = ("transformers", "peft", "trl")
PENDING = {"ParallelismConfig": "arrives with the tensor-parallel branch (ParallelismConfig / MegatronLMPlugin)"}
PENDING_MODULES = {"accelerate.parallelism_config"}


def _pending() -> bool:
    return importlib.util.find_spec("accelerate_c.parallelism_config") is None


def _sources(pkg: str):
    root = pathlib.Path(importlib.util.find_spec(pkg).origin).parent
    for path in root.rglob("*.py"):
        text = path.read_text(errors="replace")
        if "accelerate" in text:
            yield text


def _scan() -> tuple[set, set]:
    """({(module, name or None)}, {dotted attribute chains on the name `accelerate`})"""
    imports, chains = set(), set()
    for pkg in PACKAGES:
        for text in _sources(pkg):
            try:
                tree = ast.parse(text)
            except SyntaxError:
                continue
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and \
                        (node.module == "accelerate" or node.module.startswith("accelerate.")):
                    imports.update((node.module, a.name) for a in node.names)
                elif isinstance(node, ast.Import):
                    imports.update((a.name, None) for a in node.names
                                   if a.name == "accelerate" or a.name.startswith("accelerate."))
                elif isinstance(node, ast.Attribute):
                    parts, x = [], node
                    while isinstance(x, ast.Attribute):
                        parts.append(x.attr)
                        x = x.value
                    if isinstance(x, ast.Name) and x.id == "accelerate":
                        chains.add(".".join(reversed(parts)))
    return imports, chains


CHECK = r"""
import importlib, json, sys
imports, chains = json.loads(sys.argv[1])
bad = []
for mod, name in imports:
    try:
        m = importlib.import_module(mod)
        if name is not None:
            getattr(m, name)
    except Exception as exc:
        bad.append(f"from {mod} import {name}: {type(exc).__name__}: {exc}")
import accelerate
for chain in chains:
    obj = accelerate
    try:
        for part in chain.split("."):
            obj = getattr(obj, part)
    except AttributeError as exc:
        bad.append(f"accelerate.{chain}: {exc}")
import peft
files = [getattr(m, "__file__", None) or "" for m in list(sys.modules.values())]
print("RESULT " + json.dumps({"bad": bad, "files": files}))
"""


def test_every_accelerate_import_of_transformers_peft_trl_resolves():
    imports, chains = _scan()
    assert len(imports) > 40 and ("accelerate", "Accelerator") in imports, sorted(imports, key=str)  # scan sanity
    if _pending():
        imports = {(m, n) for m, n in imports if n not in PENDING and m not in PENDING_MODULES}
    payload = json.dumps([sorted(imports, key=lambda x: (x[0], x[1] or "")), sorted(chains)])
    proc = subprocess.run([sys.executable, "-c", CHECK, payload], env=clean_env(ACCELERATE_C_AS_ACCELERATE="1"),
                          cwd="/", capture_output=True, text=True, timeout=600)
    line = next((l for l in proc.stdout.splitlines() if l.startswith("RESULT ")), None)
    assert line is not None, proc.stdout[-3000:] + proc.stderr[-5000:]
    out = json.loads(line[len("RESULT "):])
    assert not out["bad"], "names that do not resolve under the switch:\n" + "\n".join(out["bad"])
    hf = [f for f in out["files"] if f.startswith(HF_DIR + os.sep)]
    assert not hf, f"HF Accelerate's own modules were imported: {hf[:5]}"


def test_parallelism_config_and_the_trainers_resolve():
    """transformers' TrainingArguments imports accelerate.parallelism_config at module level: Trainer, TRL's trainers
    and PEFT's Trainer paths need it."""
    if _pending():
        pytest.skip(f"ParallelismConfig: {PENDING['ParallelismConfig']}")
    code = ("from accelerate import ParallelismConfig\nfrom accelerate.parallelism_config import ParallelismConfig as P\n"
            "import accelerate_c\nassert ParallelismConfig is P is accelerate_c.ParallelismConfig\n"
            "from transformers import Trainer\nfrom trl import SFTTrainer\nprint('OK')")
    proc = subprocess.run([sys.executable, "-c", code], env=clean_env(ACCELERATE_C_AS_ACCELERATE="1"), cwd="/",
                          capture_output=True, text=True, timeout=300)
    assert "OK" in proc.stdout, proc.stderr[-3000:]
