# tests/test_sharded_views.py: every tensor user code can reach from a prepared model and optimizer is valid at every
# point of the loop, under every strategy (tests/scripts/views_walk.py reads them all: parameters, .grad, buffers,
# state_dict() of the wrapped and the unwrapped model, optimizer state, before the first forward, between forward
# and backward, after backward / step / zero_grad, after two synced backwards, after load_state_dict,
# unwrap_model().cpu(), free_memory and end_training). No tensor may have a shape larger than its storage (its raw
# metadata is checked before any read), and what user code reads must be what plain DDP gives on the same script
# and seed: parameters, the local gradient under no_sync and the averaged one after a synced backward (None for a
# parameter no rank used), the clipped gradients after torch's own clip_grad_norm_, buffers, state dicts, the eval
# output after load_state_dict.
# Plain DDP's reference path (one all-reduce at the end of backward, every rank stepping everything) is held to the
# default bucketed path the same way. Under bf16 (a compute copy, other numerics than DDP's autocast) the reads are
# checked for validity and for every rank seeing the same parameters. Stage 2 reads its gradients through the same
# paths as stage 3 and holds its parameters whole (HF's scripts run SHARD_GRAD_OP, ZeRO-2 and HYBRID_SHARD in
# test_hf_scripts.py).
# Not for: the engine's numerics against the single-process loop (test_sharded_engine.py).
import json
import os
import sys

import pytest

from conftest import SCRIPTS, Job, clean_env, describe_all, finish_all

WRAP = ["--fsdp_auto_wrap_policy", "TRANSFORMER_BASED_WRAP", "--fsdp_transformer_layer_cls_to_wrap", "GPT2Block"]
CASES = {
    "FULL_SHARD": (["--use_fsdp", "--fsdp_sharding_strategy", "FULL_SHARD", *WRAP], {}),
    "ZeRO-1": (["--use_deepspeed", "--zero_stage", "1"], {}),
    # (stage 3's own paths over shared memory run under FULL_SHARD above)
    "ZeRO-3 torch transport": (["--use_deepspeed", "--zero_stage", "3"], {"ACCELERATE_C_COMM": "torch"}),
    # the other data-parallel path against the default one (bucketed, with the split step over shared memory)
    "DDP reference path": ([], {"ACCELERATE_C_GRAD_SYNC": "reference", "ACCELERATE_C_SHARDED_STEP": "0"}),
}
_DDP: dict = {}


def _walk(tmp, flags, env, nproc=2):
    out = tmp / "out"
    out.mkdir()
    script = os.path.join(SCRIPTS, "views_walk.py")
    if nproc == 1:
        cmd = [sys.executable, script, "--out", str(out)]
    else:
        cmd = [sys.executable, "-m", "accelerate_c", "launch", "--num_processes", str(nproc), "--main_process_port",
               "0", *flags, script, "--out", str(out)]
    job = Job(cmd, str(tmp), "walk", clean_env(**env))
    (rc, _, _), = finish_all([job], 300)
    runs = [out / f"walk{r}.json" for r in range(nproc)]
    assert rc == 0 and all(p.exists() for p in runs), describe_all([job])
    runs = [json.loads(p.read_text()) for p in runs]
    for r, run in enumerate(runs):
        assert not run["bad"], f"rank {r}: " + "\n".join(run["bad"][:20])
    return runs


def _ddp(tmp_path_factory):
    if "runs" not in _DDP:
        _DDP["runs"] = _walk(tmp_path_factory.mktemp("ddp"), [], {})
    return _DDP["runs"]


def _same(a, b):
    if a is None or b is None:
        return a is None and b is None
    return a[:2] == b[:2] and abs(a[2] - b[2]) <= 1e-4 * (a[3] + 1.0)


@pytest.mark.parametrize("case", list(CASES))
def test_every_view_reads_as_under_ddp(case, tmp_path, tmp_path_factory):
    flags, env = CASES[case]
    got = _walk(tmp_path, flags, env)
    ref = _ddp(tmp_path_factory)
    bad = []
    for r in range(2):
        for point, rec in ref[r]["points"].items():
            mine = got[r]["points"].get(point)
            assert mine is not None, f"{case}: rank {r} did not reach '{point}'"
            bad += [f"rank {r}, {point}: {k}: {mine.get(k)} (DDP: {v})" for k, v in rec.items()
                    if not _same(v, mine.get(k, "missing"))]
    assert not bad, f"{case}: {len(bad)} reads differ from DDP's:\n" + "\n".join(bad[:30])


def test_bf16_compute_copy_views_are_valid_and_agree(tmp_path):
    got = _walk(tmp_path, ["--mixed_precision", "bf16", *CASES["FULL_SHARD"][0]], {})
    for point, rec in got[0]["points"].items():
        for k, v in rec.items():
            if ".param." in k:
                assert _same(v, got[1]["points"][point][k]), f"{point}: {k} differs between ranks"


def test_one_process_views_are_valid(tmp_path):
    _walk(tmp_path, [], {}, nproc=1)
