# tests/test_hf_names.py: every name the installed transformers, PEFT and TRL import from `accelerate` resolves under
# the switch (ACCELERATE_C_AS_ACCELERATE=1). The list is generated from their sources (every `from accelerate... import
# X`, `import accelerate...` and `accelerate.a.b` attribute chain, read with ast), never typed by hand; a fresh
# interpreter with the switch on imports each (and PEFT), and no file of HF's own package may have been imported.
# transformers' Trainer and TRL's trainers import accelerate.parallelism_config at module level: checked with it. ParallelismConfig arrives with the tensor-parallel branch: skipped, by
# name and with the reason, only while accelerate_c has no `parallelism_config` module.
# The signatures of the functions and classes added for them are HF 1.15's (names, order, defaults), and the small
# ones (constants, get_module_class_from_name, get_parameters_from_modules, load_config_from_file) give HF's results.
# Not for: the big-model behaviour (test_bigmodel.py) or the trainers (test_hf_trainer.py).
import ast
import importlib
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


SIGNATURES = [  # (HF's module, our module, names): the parameters (names, order, defaults) must be HF 1.15's
    ("accelerate.big_modeling", "accelerate_c.big_modeling",
     ["init_empty_weights", "init_on_device", "cpu_offload", "cpu_offload_with_hook", "disk_offload", "dispatch_model",
      "load_checkpoint_and_dispatch"]),
    ("accelerate.utils.modeling", "accelerate_c.utils.modeling",
     ["infer_auto_device_map", "get_balanced_memory", "get_max_memory", "get_max_layer_size", "clean_device_map",
      "compute_module_sizes", "find_tied_parameters", "check_device_map", "load_checkpoint_in_model",
      "named_module_tensors", "set_module_tensor_to_device", "convert_file_size_to_int"]),
    ("accelerate.hooks", "accelerate_c.hooks",
     ["add_hook_to_module", "remove_hook_from_module", "remove_hook_from_submodules", "attach_align_device_hook",
      "attach_execution_device_hook", "attach_align_device_hook_on_blocks", "AlignDevicesHook", "CpuOffload"]),
    ("accelerate.utils.offload", "accelerate_c.utils.offload",
     ["offload_state_dict", "offload_weight", "save_offload_index", "OffloadedWeightsLoader", "PrefixedDataset"]),
    ("accelerate.utils.fsdp_utils", "accelerate_c.utils.fsdp_utils",
     ["save_fsdp_model", "load_fsdp_model", "save_fsdp_optimizer", "load_fsdp_optimizer",
      "get_parameters_from_modules"]),
    ("accelerate.commands.config", "accelerate_c.commands.config", ["load_config_from_file"]),
    ("accelerate.commands.launch", "accelerate_c.commands.launch", ["launch_command_parser"]),
    ("accelerate.utils.dataclasses", "accelerate_c.utils.dataclasses", ["get_module_class_from_name"]),
]


def _params(obj) -> list:
    import inspect

    sig = inspect.signature(obj.__init__ if isinstance(obj, type) else obj)
    return [(p.name, p.default if p.default is not inspect.Parameter.empty else "<required>")
            for p in sig.parameters.values() if p.name != "self"]


@pytest.mark.parametrize("hf_mod,our_mod,names", SIGNATURES, ids=[s[0] for s in SIGNATURES])
def test_signatures_are_hfs(hf_mod, our_mod, names):
    hf_m, our_m = importlib.import_module(hf_mod), importlib.import_module(our_mod)
    for name in names:
        assert _params(getattr(our_m, name)) == _params(getattr(hf_m, name)), name


def test_small_names_behave_as_hfs(tmp_path):
    import torch
    from accelerate.commands.config import load_config_from_file as hf_load
    from accelerate.utils import constants as hf_constants
    from accelerate.utils.dataclasses import get_module_class_from_name as hf_class
    from accelerate.utils.fsdp_utils import get_parameters_from_modules as hf_params

    from accelerate_c.commands.config import default_config_file, load_config_from_file
    from accelerate_c.utils import constants
    from accelerate_c.utils.dataclasses import get_module_class_from_name
    from accelerate_c.utils.fsdp_utils import get_parameters_from_modules

    for name in ("FSDP_SHARDING_STRATEGY", "FSDP_AUTO_WRAP_POLICY", "FSDP_BACKWARD_PREFETCH", "FSDP_STATE_DICT_TYPE",
                 "SAFE_WEIGHTS_NAME", "WEIGHTS_NAME", "FSDP_MODEL_NAME"):
        assert getattr(constants, name) == getattr(hf_constants, name), name
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Sequential(torch.nn.ReLU(), torch.nn.Linear(2, 3)))
    for cls in ("ReLU", "Linear", "Sequential", "Nope"):
        assert get_module_class_from_name(model, cls) is hf_class(model, cls)
    assert get_parameters_from_modules("1\\.1", model, "cpu") == hf_params("1\\.1", model, "cpu")
    assert get_parameters_from_modules([model[0]], model, "cpu") == hf_params([model[0]], model, "cpu")
    assert get_parameters_from_modules(None, model, "cpu") == set()
    path = tmp_path / "c.yaml"
    path.write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_CPU\nnum_processes: 2\n"
                    "mixed_precision: bf16\nuse_cpu: true\n")
    ours, hf = load_config_from_file(str(path)).to_dict(), hf_load(str(path)).to_dict()
    for key in ("distributed_type", "num_processes", "mixed_precision", "use_cpu"):
        assert ours[key] == hf[key], key
    with pytest.raises(FileNotFoundError, match="missing.yaml"):
        load_config_from_file(str(tmp_path / "missing.yaml"))
    assert isinstance(default_config_file, str)
