# tests/test_sharded_units.py: the sharded engine's units and flat layout without communication: the three wrap
# policies (transformer layer classes by name, size-based, the whole model), tied weights in the deepest unit holding
# every use, ignored modules and frozen parameters left out (replicated), bad settings named in the error; each
# unit's padding and the per-rank pieces covering every element exactly once.
# Not for: training under the engine (test_sharded_engine.py).
import pytest
import torch

from accelerate_c.sharding.flat import FlatUnit
from accelerate_c.sharding.units import build_units


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    m = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=3, n_head=2))
    m.transformer.wpe.weight.requires_grad_(False)
    return m


def test_transformer_wrap_units_and_tied_weights():
    m = _gpt2()
    units, replicated = build_units(m, "transformer_based_wrap", ("GPT2Block",))
    assert [u.name for u in units] == ["", "transformer.h.0", "transformer.h.1", "transformer.h.2"]
    root = dict(units[0].params)
    assert "transformer.wte.weight" in root and "lm_head.weight" not in root  # tied: once, in the root
    assert [n for n, _ in replicated] == ["transformer.wpe.weight"]          # frozen: out of the units
    seen = [id(p) for u in units for _, p in u.params]
    assert len(seen) == len(set(seen))
    trainable = {id(p) for p in m.parameters() if p.requires_grad}
    assert set(seen) == trainable
    assert all(n.startswith("transformer.h.1.") for n, _ in units[2].params)


def test_size_wrap_no_wrap_and_ignored():
    m = torch.nn.Sequential(torch.nn.Linear(10, 10), torch.nn.Sequential(torch.nn.Linear(10, 10), torch.nn.Linear(10, 2)))
    units, rep = build_units(m, "size_based_wrap", min_num_params=100)
    assert [u.name for u in units] == ["", "0", "1.0"]  # the root keeps the rest
    names = {u.name: [n for n, _ in u.params] for u in units}
    assert names["0"] == ["0.weight", "0.bias"] and names["1.0"] == ["1.0.weight", "1.0.bias"]
    assert names[""] == ["1.1.weight", "1.1.bias"]
    units, rep = build_units(m, "no_wrap", ignored_modules=[r"1\.1"])
    assert [u.name for u in units] == [""] and [n for n, _ in rep] == ["1.1.weight", "1.1.bias"]
    units, rep = build_units(m, "no_wrap", ignored_modules=[m[0]])
    assert [n for n, _ in rep] == ["0.weight", "0.bias"]


def test_bad_settings_are_named():
    m = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="auto_wrap_policy='nope'"):
        build_units(m, "nope")
    with pytest.raises(ValueError, match="GPT2Block"):
        build_units(m, "transformer_based_wrap", ("GPT2Block",))
    with pytest.raises(ValueError, match="transformer_layer_cls"):
        build_units(m, "transformer_based_wrap", ())
    with pytest.raises(TypeError, match="ignored_modules"):
        build_units(m, "no_wrap", ignored_modules=[3])


@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_pieces_cover_every_element_once(world):
    m = torch.nn.Sequential(torch.nn.Linear(7, 3), torch.nn.Linear(3, 1))  # 28 elements: padded on 3 and 5 ranks
    params = list(m.named_parameters())
    count = {n: torch.zeros(p.numel()) for n, p in params}
    for r in range(world):
        u = FlatUnit(0, "", m, params, world, r)
        assert u.padded % world == 0 and u.padded - u.numel < world and u.shard * world == u.padded
        assert [t[0] for t in u.table()] == [n for n, _ in params]
        covered = 0
        for e in u.entries:
            count[e.name][e.lo:e.hi] += 1
            a, b = u.shard_slice(e)
            assert 0 <= a <= b <= u.shard
            covered += e.piece_numel
        assert covered == min(u.hi, u.numel) - min(u.lo, u.numel)
    assert all(bool((c == 1).all()) for c in count.values())
    full = torch.empty(u.padded)
    u.pack(full, [p.data for _, p in params])
    for v, (_, p) in zip(u.views(full), params):
        assert torch.equal(v, p.data)
    assert (full[u.numel:] == 0).all()
