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
# The multi-process runs share one launch (views_walk.py --cases, the state reset between runs; "after end_training"
# is read with the default process group still up in every run but the last, FULL_SHARD).
# Not for: the engine's numerics against the single-process loop (test_sharded_engine.py).
import json

from fold import Case, check_each, launcher_env, run_folded

WRAP = ["--fsdp_auto_wrap_policy", "TRANSFORMER_BASED_WRAP", "--fsdp_transformer_layer_cls_to_wrap", "GPT2Block"]
CASES = {  # launcher flags, environment; each held to plain DDP's reads (the first case of the launch)
    "ZeRO-1": (["--use_deepspeed", "--zero_stage", "1"], {}),
    # the other data-parallel path against the default one (bucketed, with the split step over shared memory)
    "DDP reference path": ([], {"ACCELERATE_C_GRAD_SYNC": "reference", "ACCELERATE_C_SHARDED_STEP": "0"}),
    # (stage 3's own paths over shared memory run under FULL_SHARD below)
    "ZeRO-3 torch transport": (["--use_deepspeed", "--zero_stage", "3"], {"ACCELERATE_C_COMM": "torch"}),
    # last of the launch: its end_training is the real one (the default process group destroyed before the read)
    "FULL_SHARD": (["--use_fsdp", "--fsdp_sharding_strategy", "FULL_SHARD", *WRAP], {}),
}
BF16 = ["--mixed_precision", "bf16", *CASES["FULL_SHARD"][0]]  # valid reads, every rank the same parameters
_DS, _FSDP = "DistributedType.DEEPSPEED", "DistributedType.FSDP"
SETUP = {  # what each run got (views_walk.py's "setup"): the flags and variables took effect
    "DDP": {"strategy": "BucketedDataParallel", "distributed_type": "DistributedType.MULTI_CPU"},
    "ZeRO-1": {"distributed_type": _DS, "stage": 1, "transport": "auto"},
    "DDP reference path": {"strategy": "DataParallel", "grad_sync": "reference", "sharded_step": "False"},
    "ZeRO-3 torch transport": {"distributed_type": _DS, "stage": 3, "transport": "torch"},
    "bf16 FULL_SHARD": {"distributed_type": _FSDP, "stage": 3, "mixed_precision": "bf16"},
    "FULL_SHARD": {"distributed_type": _FSDP, "stage": 3, "mixed_precision": "no", "transport": "auto"},
}


def _valid(tmp, name, nproc):
    runs = [tmp / name / f"walk{r}.json" for r in range(nproc)]
    assert all(p.exists() for p in runs), f"{name}: no walk written"
    runs = [json.loads(p.read_text()) for p in runs]
    for r, run in enumerate(runs):
        assert not run["bad"], f"rank {r}: " + "\n".join(run["bad"][:20])
        want = SETUP.get(name, {})
        assert {k: run["setup"].get(k) for k in want} == want, (r, run["setup"])
    return runs


def _same(a, b):
    if a is None or b is None:
        return a is None and b is None
    return a[:2] == b[:2] and abs(a[2] - b[2]) <= 1e-4 * (a[3] + 1.0)


def test_every_view_reads_as_under_ddp(tmp_path):
    """Plain DDP, then each of CASES and bf16 FULL_SHARD, in one launch of views_walk.py --cases (each case given the
    variables the launcher gives its ranks for the case's flags, tests/fold.py launcher_env)."""
    cases = [Case(name, [], {**launcher_env(flags, 2), **env}) for name, (flags, env) in CASES.items()]
    cases = [Case("DDP", [], launcher_env([], 2))] + cases[:-1] + [Case("bf16 FULL_SHARD", [], launcher_env(BF16, 2)),
                                                                 cases[-1]]
    outs = run_folded("views_walk.py", cases, tmp_path, nproc=2, timeout=300, per_case_s=90)
    ref = _valid(tmp_path, "DDP", 2)  # (every case's walk is written where run_folded put it: tmp_path / name)

    def check(c):
        got = _valid(tmp_path, c.name, 2)
        if c.name == "bf16 FULL_SHARD":  # a compute copy (other numerics than DDP's autocast): the ranks agree
            for point, rec in got[0]["points"].items():
                for k, v in rec.items():
                    if ".param." in k:
                        assert _same(v, got[1]["points"][point][k]), f"{point}: {k} differs between ranks"
            return
        bad = []
        for r in range(2):
            for point, rec in ref[r]["points"].items():
                mine = got[r]["points"].get(point)
                assert mine is not None, f"rank {r} did not reach '{point}'"
                bad += [f"rank {r}, {point}: {k}: {mine.get(k)} (DDP: {v})" for k, v in rec.items()
                        if not _same(v, mine.get(k, "missing"))]
        assert not bad, f"{len(bad)} reads differ from DDP's:\n" + "\n".join(bad[:30])

    assert set(outs) == {c.name for c in cases}
    check_each(cases[1:], check)


def test_one_process_views_are_valid(run, tmp_path):
    run("views_walk.py", ["--out", str(tmp_path / "one")], nproc=1, timeout=300)
    _valid(tmp_path, "one", 1)
