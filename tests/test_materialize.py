# test_materialize.py: sharded construction's materialisation (accelerate_c/sharding/materialize.py) on one
# process: a meta-device model materialised module by module equals its eager reference bitwise (a plain torch
# model: eager construction with the same seed; a transformers GPT-2 from a config: eager + reinitialize), tied
# weights stay tied, each unit's tensors reach the sink before the next unit is allocated (the peak is one unit),
# and a module that cannot be initialised is an error naming it.
# Not for: the engine packing shards (test_sharded_*.py).
import pytest
import torch
from torch import nn

from accelerate_c.sharding.materialize import materialize_model, materialize_stream, meta_names, reinitialize


def _mlp():
    return nn.Sequential(nn.Linear(5, 7), nn.BatchNorm1d(7), nn.ReLU(), nn.Linear(7, 3), nn.LayerNorm(3))


def _gpt2_config():
    transformers = pytest.importorskip("transformers")
    return transformers, transformers.GPT2Config(n_layer=3, n_embd=32, n_head=4, vocab_size=97, n_positions=16,
                                                 bos_token_id=0, eos_token_id=0)


def test_torch_model_equals_eager_construction():
    torch.manual_seed(3)
    eager = _mlp()
    with torch.device("meta"):
        meta = _mlp()
    torch.manual_seed(3)
    materialize_model(meta)
    assert meta_names(meta) is None
    for (k, a), (_, b) in zip(eager.state_dict().items(), meta.state_dict().items()):
        assert torch.equal(a, b), k


def test_transformers_model_equals_reinitialized_eager_and_stays_tied():
    transformers, cfg = _gpt2_config()
    eager = transformers.GPT2LMHeadModel(cfg)
    torch.manual_seed(5)
    reinitialize(eager)
    with torch.device("meta"):
        meta = transformers.GPT2LMHeadModel(cfg)
    torch.manual_seed(5)
    seen = []
    materialize_stream(meta, lambda name, t, is_param: seen.append(name), units=list(meta.transformer.h))
    assert meta_names(meta) is None
    assert meta.lm_head.weight is meta.transformer.wte.weight
    ref = eager.state_dict()
    for k, v in meta.state_dict().items():
        assert torch.equal(v, ref[k]), k
    assert len(seen) == len(set(seen)) == len(dict(meta.named_parameters())) + len(dict(meta.named_buffers()))
    # the scaled residual init (set from the parent attention/MLP module) is in place
    std = meta.transformer.h[0].attn.c_proj.weight.std().item()
    assert std < 0.7 * cfg.initializer_range


def test_each_unit_reaches_the_sink_before_the_next_is_allocated():
    transformers, cfg = _gpt2_config()
    with torch.device("meta"):
        meta = transformers.GPT2LMHeadModel(cfg)
    layers = list(meta.transformer.h)
    events = []

    def sink(name, t, is_param):
        # when a tensor of layer 0 is handed over, layer 1 is still unallocated
        events.append((name, meta.transformer.h[1].attn.c_attn.weight.is_meta))

    materialize_stream(meta, sink, units=layers)
    layer0 = [still_meta for name, still_meta in events if name.startswith("transformer.h.0.")]
    assert layer0 and all(layer0)
    # the tied embedding is handed over once, with the root unit: after every layer's tensors
    names = [e[0] for e in events]
    assert names.count("transformer.wte.weight") == 1
    assert names.index("transformer.wte.weight") > max(i for i, n in enumerate(names) if n.startswith("transformer.h."))


class _NoInit(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(3))


def test_module_without_an_init_is_an_error_naming_it():
    with torch.device("meta"):
        m = nn.Sequential(nn.Linear(2, 3), _NoInit())
    with pytest.raises(ValueError, match="_NoInit.*reset_parameters"):
        materialize_model(m)


def test_real_tensors_are_handed_over_unchanged():
    m = _mlp()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    got = {}
    materialize_stream(m, lambda name, t, is_param: got.__setitem__(name, t))
    assert set(got) == set(before) and all(torch.equal(got[k], before[k]) for k in before)
