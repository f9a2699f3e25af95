# tests/test_pipeline_parity.py: the pipeline engine on real gloo processes (tests/scripts/pp_train.py) against one
# process on the same global batch: every schedule (GPipe, 1F1B, ZB-H1, interleaved 1F1B with v=2) with pp=2 and
# m in {2, 4, 8}, on a transformers Llama and a GPT-2 (tied embedding and head) built from a config, plus a tied Llama:
# 8 steps of AdamW on each stage's parameters, losses within 1e-5 relative on every rank, weights within rtol 1e-5,
# eval outputs equal; pp=4 with an 8-layer Llama; stage 0's measured activation bytes under 1F1B at most p/m of
# GPipe's + 10 %; a meta-device model pruned before it is materialised; a stage that raises mid-schedule stops every
# rank promptly with the reason, over the shm rings and over torch's p2p.
# Not for: timing (benchmarks/pp_step.py), the schedules alone (test_pipeline_schedules.py), one-process behaviour
# (test_pipeline_engine.py).
import json
import os

import pytest

SCHEDULES = [("gpipe", ""), ("1f1b", ""), ("zb_h1", ""), ("interleaved_1f1b", ":2")]


def _cases(model):
    return ",".join(f"{model}:{s}:{m}{v}" for s, v in SCHEDULES for m in (2, 4, 8))


def _results(out, n):
    return [json.load(open(os.path.join(out, f"result{r}.json"))) for r in range(n)]


@pytest.mark.parametrize("model", ["llama", "gpt2"])
def test_parity_pp2(tmp_path, run, model):
    cases = _cases(model) + (",llama_tied:1f1b:4,llama_tied:zb_h1:8" if model == "llama" else "")
    run("pp_train.py", ["--cases", cases, "--out", str(tmp_path)], nproc=2, timeout=400)
    r0, r1 = _results(tmp_path, 2)
    assert len(r0) == len(cases.split(","))
    for a, b in zip(r0, r1):
        assert a["losses"] == b["losses"]  # the loss reaches every rank (broadcast from the last stage)
    first = {"llama": "model.embed_tokens.weight", "gpt2": "transformer.wte.weight"}[model]
    assert first in r0[0]["held"] and first not in r1[0]["held"]
    assert "lm_head.weight" in r1[0]["held"] and "lm_head.weight" not in r0[0]["held"]
    layer = {"llama": "model.layers.", "gpt2": "transformer.h."}[model]
    assert {n.split(".")[2] for n in r0[0]["held"] if n.startswith(layer)} == {"0", "1"}
    assert {n.split(".")[2] for n in r1[0]["held"] if n.startswith(layer)} == {"2", "3"}
    # checkpoints: every logical tensor has one writer, a rank that holds it (a tied weight: its first holder)
    owners = r0[0]["owners"]
    assert r1[0]["owners"] == owners  # every rank computes the same writers
    tied = {"lm_head.weight": "transformer.wte.weight"} if model == "gpt2" else {}
    assert all(tied.get(n, n) in (r0, r1)[owners[n]][0]["held"] for n in owners)
    assert owners["lm_head.weight"] == (0 if model == "gpt2" else 1)  # GPT-2's head is the tied wte: rank 0


def test_parity_pp4(tmp_path, run):
    cases = "llama8:1f1b:4,llama8:zb_h1:8,llama8:interleaved_1f1b:4:2"
    run("pp_train.py", ["--cases", cases, "--out", str(tmp_path)], nproc=4, timeout=400)
    held = [r[0]["held"] for r in _results(tmp_path, 4)]
    assert [sorted({n.split(".")[2] for n in h if n.startswith("model.layers.")}) for h in held] == [
        ["0", "1"], ["2", "3"], ["4", "5"], ["6", "7"]]


def test_memory_and_meta(tmp_path, run):
    """Stage 0 holds p micro-batches' activations under 1F1B, m under GPipe (measured: the tensors autograd saves);
    a model built on the meta device is pruned first, then only the stage's tensors are materialised."""
    run("pp_train.py", ["--mode", "memory", "--micro_batches", "8", "--out", str(tmp_path)], nproc=2, timeout=300)
    r0, r1 = _results(tmp_path, 2)
    assert r0["1f1b"] <= (2 / 8) * r0["gpipe"] * 1.10, r0
    assert r0["gpipe"] > 0 and r1["1f1b"] < r1["gpipe"]
    assert r0["meta"]["meta_left"] == [] and r1["meta"]["meta_left"] == []
    assert r0["meta"]["tied_equal"] and r1["meta"]["tied_equal"]
    assert set(r0["meta"]["held"]).isdisjoint(r1["meta"]["held"] + ["lm_head.weight"])
    assert r0["meta"]["loss"] == r1["meta"]["loss"] and r0["meta"]["loss"] > 0


@pytest.mark.parametrize("transport,fail_rank", [("auto", 1), ("torch", 0)])
def test_failing_stage_stops_everyone(tmp_path, run, transport, fail_rank):
    run("pp_train.py", ["--mode", "fail", "--transport", transport, "--fail_rank", str(fail_rank), "--out",
                        str(tmp_path)], nproc=2, timeout=120)
    res = _results(tmp_path, 2)
    assert res[fail_rank]["raised"] == "ValueError: injected failure in the stage"
    other = res[1 - fail_rank]["raised"]
    assert other is not None and f"pipeline rank {fail_rank} raised ValueError: injected failure" in other, other
    assert all(r["seconds"] < 20 for r in res), res  # promptly: not the group's 60 s timeout
