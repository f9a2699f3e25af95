# tests/test_as_accelerate.py: the switch that serves `import accelerate` from accelerate_c (accelerate_c/as_accelerate.py)
# through its three ways in: ACCELERATE_C_AS_ACCELERATE=1 for `python script.py` (the installed .pth hook), the
# in-process install_as_accelerate(), and `launch --as_accelerate`. Each check runs in a fresh interpreter (the
# pytest process imports HF's package for other tests). Checked: the module objects are ours, transformers'
# availability and version probes see 1.15.0, a module we lack is an ImportError naming it, no file under HF's
# installed package is ever imported, HF already imported refuses the switch, a bad value stops every import,
# unset costs nothing, `env` reports it. Not for: the names themselves (test_hf_names.py).
import json
import os
import subprocess
import sys

from conftest import ROOT, clean_env, free_port

import accelerate as hf_accelerate

HF_DIR = os.path.dirname(hf_accelerate.__file__)

PROBE = r"""
import importlib, importlib.metadata, importlib.util, json, sys
out = {}
import accelerate
import accelerate_c
out["file"] = accelerate.__file__
out["version"] = accelerate.__version__
out["metadata"] = importlib.metadata.version("accelerate")
out["spec"] = importlib.util.find_spec("accelerate") is not None
from transformers.utils import import_utils
out["tf_available"] = import_utils.is_accelerate_available()
from accelerate import Accelerator
out["same_class"] = Accelerator is accelerate_c.Accelerator
import accelerate.utils.operations as ops_hf_path
import accelerate_c.utils.operations as ops_ours
out["same_module"] = ops_hf_path is ops_ours
import accelerate.state
accelerate.state.SOME_FLAG = 7
out["monkeypatch_reaches"] = getattr(sys.modules["accelerate_c.runtime.state"], "SOME_FLAG", None) == 7
accelerate.NEW_NAME = 3
out["top_setattr_reaches"] = getattr(accelerate_c, "NEW_NAME", None) == 3
for bad in ("accelerate.no_such_module", "accelerate.utils.no_such_module"):
    try:
        importlib.import_module(bad)
        out[bad] = "imported"
    except ImportError as exc:
        out[bad] = str(exc)
try:
    from accelerate.utils import no_such_name
    out["name"] = "imported"
except ImportError as exc:
    out["name"] = str(exc)
out["files"] = sorted(getattr(m, "__file__", None) or "" for m in list(sys.modules.values()))
print("PROBE " + json.dumps(out))
"""


def _python(code: str, env: dict, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], env=env, cwd="/", capture_output=True, text=True,
                          timeout=timeout)


def _probe(text: str) -> dict:
    line = next((l for l in text.splitlines() if l.startswith("PROBE ")), None)
    assert line is not None, text[-4000:]
    return json.loads(line[len("PROBE "):])


def _check(out: dict) -> None:
    assert out["file"].startswith(os.path.join(ROOT, "accelerate_c")) or "site-packages/accelerate_c" in out["file"]
    assert out["version"] == out["metadata"] == "1.15.0"
    assert out["spec"] and out["tf_available"], out
    assert out["same_class"] and out["same_module"] and out["monkeypatch_reaches"] and out["top_setattr_reaches"]
    for bad in ("accelerate.no_such_module", "accelerate.utils.no_such_module"):
        assert bad in out[bad] and "accelerate_c" in out[bad], out[bad]
    assert "no_such_name" in out["name"], out["name"]
    hf_files = [f for f in out["files"] if f.startswith(HF_DIR + os.sep)]
    assert not hf_files, f"HF Accelerate's own modules were imported under the switch: {hf_files[:5]}"


def test_environment_variable_serves_accelerate_from_accelerate_c():
    proc = _python(PROBE, clean_env(ACCELERATE_C_AS_ACCELERATE="1"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    _check(_probe(proc.stdout))


def test_in_process_call_and_refusal_after_hf_was_imported():
    code = "import accelerate_c; accelerate_c.install_as_accelerate()\n" + PROBE
    proc = _python(code, clean_env())
    assert proc.returncode == 0, proc.stderr[-4000:]
    _check(_probe(proc.stdout))
    late = ("import accelerate, accelerate_c\n"
            "try:\n    accelerate_c.install_as_accelerate()\nexcept ImportError as e:\n    print('REFUSED', e)\n")
    proc = _python(late, clean_env())
    assert "REFUSED" in proc.stdout and "already imported" in proc.stdout and HF_DIR in proc.stdout, proc.stdout


def test_bad_value_stops_every_import_and_unset_costs_nothing():
    proc = _python("import accelerate", clean_env(ACCELERATE_C_AS_ACCELERATE="maybe"))
    assert proc.returncode != 0
    assert "ACCELERATE_C_AS_ACCELERATE='maybe'" in proc.stderr and "cannot import 'accelerate'" in proc.stderr
    proc = _python("import sys; print('MODS', sorted(m for m in sys.modules if m.startswith('accelerate')))",
                   clean_env())
    assert "MODS []" in proc.stdout, proc.stdout + proc.stderr
    proc = _python("import sys, accelerate; print('OFF', accelerate.__file__)", clean_env(ACCELERATE_C_AS_ACCELERATE="0"))
    assert f"OFF {HF_DIR}" in proc.stdout, proc.stdout + proc.stderr


def test_env_command_reports_the_switch():
    code = "from accelerate_c.commands.env import collect; print('SWITCH', collect()[next(k for k in collect() if 'resolves' in k)])"
    on = _python(code, clean_env(ACCELERATE_C_AS_ACCELERATE="1")).stdout
    off = _python(code, clean_env()).stdout
    assert "SWITCH yes" in on and "SWITCH no" in off, (on, off)


def test_launch_flag_turns_the_switch_on_in_the_ranks(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("import accelerate, os, sys\n"
                      "from accelerate import PartialState\n"
                      "s = PartialState()\n"
                      "open(os.path.join(sys.argv[1], f'r{s.process_index}'), 'w').write(accelerate.__file__ + ' '"
                      " + accelerate.__version__ + ' ' + type(s).__module__)\n")
    env = clean_env()
    env.pop("PYTHONPATH")  # the installed package (editable), so the .pth hook is there as for a user
    cmd = [sys.executable, "-m", "accelerate_c", "launch", "-q", "--cpu", "--as_accelerate", "--num_processes", "2",
           "--main_process_port", str(free_port()), str(script), str(tmp_path)]
    proc = subprocess.run(cmd, env=env, cwd=str(tmp_path), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for r in range(2):
        text = (tmp_path / f"r{r}").read_text()
        assert "accelerate_c" in text.split()[0] and text.split()[1] == "1.15.0", text
        assert text.split()[2].startswith("accelerate_c."), text
