# tests/test_utils_helpers.py: HF 1.15's small `accelerate.utils` helpers and constants under accelerate_c.utils, each
# run side by side with HF's own on the same inputs: the checkpoint file-name constants, get_pretty_name,
# merge_dicts, convert_bytes, recursive_getattr, get_module_children_bottom_up, is_port_in_use, check_os_kernel,
# the environment readers (get_int_from_env, parse_flag_from_env, parse_choice_from_env) and
# purge_accelerate_environment, convert_outputs_to_fp32, pad_input_tensors, wait_for_everyone and
# clean_state_dict_for_safetensors.
# Not for: the utilities with behaviour of their own (test_utils_api.py), collectives (test_operations.py).
import logging
import os
import pickle
import platform
import socket

import pytest
import torch

import accelerate.utils as hf_utils
import accelerate_c.utils as ac_utils

pytestmark = pytest.mark.usefixtures("clean_state")

CONSTANTS = ("MODEL_NAME", "OPTIMIZER_NAME", "RNG_STATE_NAME", "SAFE_MODEL_NAME", "SAFE_WEIGHTS_INDEX_NAME",
             "SAFE_WEIGHTS_NAME", "SAFE_WEIGHTS_PATTERN_NAME", "SAMPLER_NAME", "SCALER_NAME", "SCHEDULER_NAME",
             "WEIGHTS_INDEX_NAME", "WEIGHTS_NAME", "WEIGHTS_PATTERN_NAME", "PROFILE_PATTERN_NAME")


def test_constants_equal_hf():
    assert {n: getattr(ac_utils, n) for n in CONSTANTS} == {n: getattr(hf_utils, n) for n in CONSTANTS}


class _Outer:
    class Inner:
        def method(self):
            pass


@pytest.mark.parametrize("obj", [len, _Outer, _Outer.Inner, _Outer.Inner.method, _Outer.Inner(), lambda: 0,
                                 torch.nn.Linear(1, 1), "text", 3], ids=range(9))
def test_get_pretty_name(obj):
    assert ac_utils.get_pretty_name(obj) == hf_utils.get_pretty_name(obj)


def test_merge_dicts_and_recursive_getattr():
    def make():
        return {"a": 1, "b": {"c": 2, "d": {"e": 3}}}, {"b": {"d": {"f": 4}, "g": 5}, "h": 6}

    (s1, d1), (s2, d2) = make(), make()
    assert ac_utils.merge_dicts(s1, d1) == hf_utils.merge_dicts(s2, d2) == d1
    model = torch.nn.Sequential(torch.nn.Sequential(torch.nn.Linear(2, 3)))
    for path in ("0", "0.0", "0.0.weight"):
        assert ac_utils.recursive_getattr(model, path) is hf_utils.recursive_getattr(model, path)
    shape = "0.0.weight.shape"
    assert ac_utils.recursive_getattr(model, shape) == hf_utils.recursive_getattr(model, shape)
    for getter in (ac_utils.recursive_getattr, hf_utils.recursive_getattr):
        with pytest.raises(AttributeError):
            getter(model, "0.missing")


def test_convert_bytes():
    for size in (0, 1, 1023, 1024, 1536, 10**6, 2**30 - 1, 2**30, 3.5 * 2**40, 2**50, 7 * 2**60):
        assert ac_utils.convert_bytes(size) == hf_utils.convert_bytes(size), size


@pytest.mark.parametrize("fqns", [False, True])
def test_module_children_bottom_up(fqns):
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=1))
    ours = ac_utils.get_module_children_bottom_up(model, return_fqns=fqns)
    hf = hf_utils.get_module_children_bottom_up(model, return_fqns=fqns)
    if fqns:
        assert [n for n, _ in ours] == [n for n, _ in hf] and all(a is b for (_, a), (_, b) in zip(ours, hf))
    else:
        assert len(ours) == len(hf) and all(a is b for a, b in zip(ours, hf))
    assert (ours[-1][1] if fqns else ours[-1]) is model


def test_is_port_in_use():
    with socket.socket() as s:
        s.bind(("localhost", 0))
        s.listen(1)
        port = s.getsockname()[1]
        assert ac_utils.is_port_in_use(port) and hf_utils.is_port_in_use(port)
    assert ac_utils.is_port_in_use(port) == hf_utils.is_port_in_use(port) is False


@pytest.mark.parametrize("release", ["5.4.0-150-generic", "4.19.0", "5.5.0", "6.8.0-1-azure", "unknown"])
def test_check_os_kernel(monkeypatch, caplog, release):
    import accelerate

    import accelerate_c

    real = platform.uname()
    monkeypatch.setattr(platform, "uname", lambda: real._replace(system="Linux", release=release))
    accelerate.PartialState()
    accelerate_c.PartialState()
    messages = []
    for check in (ac_utils.check_os_kernel, hf_utils.check_os_kernel):
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            try:
                check()
            except Exception as e:  # HF's version parser refuses a release without a version in it
                messages.append(type(e).__name__)
                continue
        messages.append([r.getMessage() for r in caplog.records if "kernel version" in r.getMessage()])
    old = release.split("-")[0] in ("5.4.0", "4.19.0")
    if release == "unknown":
        assert messages[0] == [] and messages[1] in ([], "ValueError", "TypeError", "InvalidVersion"), messages
    else:
        assert messages[0] == messages[1] and len(messages[0]) == (1 if old else 0), messages


_ENV = ("HELPERS_A", "HELPERS_B", "HELPERS_FLAG")


@pytest.mark.parametrize("env", [{}, {"HELPERS_A": "3"}, {"HELPERS_A": "-1", "HELPERS_B": "0"},
                                 {"HELPERS_B": "x"}, {"HELPERS_FLAG": "yes"}, {"HELPERS_FLAG": "OFF"},
                                 {"HELPERS_FLAG": "maybe"}], ids=range(7))
def test_environment_readers(monkeypatch, env):
    for k in _ENV:
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)

    def outcome(fn, *args):
        try:
            return ("ok", fn(*args))
        except Exception as e:
            return ("error", type(e).__name__)

    calls = (("get_int_from_env", (["HELPERS_A", "HELPERS_B"], 7)), ("parse_flag_from_env", ("HELPERS_FLAG",)),
             ("parse_flag_from_env", ("HELPERS_FLAG", True)), ("parse_choice_from_env", ("HELPERS_FLAG",)),
             ("parse_choice_from_env", ("HELPERS_FLAG", "fp16")))
    for name, args in calls:
        assert outcome(getattr(ac_utils, name), *args) == outcome(getattr(hf_utils, name), *args), (name, args)


def test_purge_accelerate_environment(monkeypatch):
    monkeypatch.setenv("ACCELERATE_KEPT", "before")

    def body():
        os.environ["ACCELERATE_MIXED_PRECISION"] = "fp16"
        os.environ["ACCELERATE_KEPT"] = "changed"
        os.environ["OTHER_HELPERS_VAR"] = "stays"
        raise RuntimeError("the body fails")

    for purge in (ac_utils.purge_accelerate_environment, hf_utils.purge_accelerate_environment):
        with pytest.raises(RuntimeError):
            purge(body)()
        assert "ACCELERATE_MIXED_PRECISION" not in os.environ and os.environ["ACCELERATE_KEPT"] == "before"
        assert os.environ.pop("OTHER_HELPERS_VAR") == "stays"

        @purge
        class Cases:
            def test_sets(self):
                os.environ["ACCELERATE_FROM_CLASS"] = "1"

            def helper_sets(self):
                os.environ["ACCELERATE_FROM_HELPER"] = "1"

        class SubCases(Cases):
            def test_sub(self):
                os.environ["ACCELERATE_FROM_SUBCLASS"] = "1"

        for case in (Cases(), SubCases()):
            case.test_sets()
        SubCases().test_sub()
        Cases().helper_sets()  # not a test method: not wrapped, as HF
        assert [k for k in os.environ if k.startswith("ACCELERATE_FROM")] == ["ACCELERATE_FROM_HELPER"]
        del os.environ["ACCELERATE_FROM_HELPER"]


def test_convert_outputs_to_fp32():
    def forward(x):
        return {"logits": x.to(torch.bfloat16), "aux": [x.half(), x.double(), torch.arange(3)], "n": 1}

    x = torch.randn(4, 3)
    ours, hf = ac_utils.convert_outputs_to_fp32(forward), hf_utils.convert_outputs_to_fp32(forward)
    a, b = ours(x), hf(x)
    assert a["logits"].dtype == b["logits"].dtype == torch.float32 and torch.equal(a["logits"], b["logits"])
    assert [t.dtype for t in a["aux"]] == [t.dtype for t in b["aux"]] == [torch.float32, torch.float64, torch.int64]
    assert a["n"] == b["n"] == 1
    assert isinstance(ours.__wrapped__, ac_utils.ConvertOutputsToFp32) and ours.__wrapped__.__wrapped__ is forward
    with pytest.raises(pickle.PicklingError, match="unwrap the model"):
        pickle.dumps(ours.__wrapped__)


@pytest.mark.parametrize("dim", [0, 1])
def test_pad_input_tensors(dim):
    for batch in range(1, 10):
        for nproc in range(1, 6):
            # dim=1: HF still pads dim 0 but copies along dim 1, which fails unless nothing is padded; ours alike
            t = torch.arange(batch * 3, dtype=torch.float32).reshape(batch, 3) + 1
            data = {"x": t, "y": [t[:, :1]]}
            try:
                hf = hf_utils.pad_input_tensors(data, batch, nproc, dim=dim)
            except Exception as e:
                with pytest.raises(type(e)):
                    ac_utils.pad_input_tensors(data, batch, nproc, dim=dim)
                continue
            ours = ac_utils.pad_input_tensors(data, batch, nproc, dim=dim)
            assert torch.equal(ours["x"], hf["x"]) and torch.equal(ours["y"][0], hf["y"][0]), (batch, nproc)
    for pad in (ac_utils.pad_input_tensors, hf_utils.pad_input_tensors):
        with pytest.raises(TypeError):
            pad({"x": torch.zeros(2), "s": "text"}, 2, 4)


def test_wait_for_everyone_on_one_process():
    assert ac_utils.wait_for_everyone() is None


def test_clean_state_dict_for_safetensors_drops_tied_aliases_like_hf():
    import accelerate

    accelerate.PartialState()  # HF's warning about the dropped alias needs its state
    emb = torch.nn.Embedding(5, 4)
    head = torch.nn.Linear(4, 5, bias=False)
    head.weight = emb.weight
    state = {"embed.weight": emb.weight.detach(), "head.weight": head.weight.detach(),
             "other": torch.randn(2, 2).t()}
    ours = ac_utils.clean_state_dict_for_safetensors(dict(state))
    hf = hf_utils.clean_state_dict_for_safetensors(dict(state))
    assert sorted(ours) == sorted(hf) == ["embed.weight", "other"]
    for k in ours:
        assert torch.equal(ours[k], hf[k]) and ours[k].is_contiguous() and hf[k].is_contiguous()
