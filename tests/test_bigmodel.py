# tests/test_bigmodel.py: big-model inference (accelerate_c/bigmodel/) against HF Accelerate 1.15 on the same input: sizes,
# budgets and device maps of a Llama built from a config (several budgets, dtypes, no-split classes, tied weights);
# load_checkpoint_and_dispatch from single and sharded safetensors with CPU + disk offload gives the full model's
# logits (bitwise, twice), as HF's does, with most offloaded modules' weights taken from the background reader; cpu_offload, disk_offload,
# cpu_offload_with_hook and the hooks; tied weights with the whole model on disk; transformers' from_pretrained(device_map="auto", max_memory=...) under the
# switch; bad input (unknown module / device in a map, a budget below the largest layer, checkpoint keys or shapes
# that differ): errors naming them, nothing loaded. The RegionPool that offloaded reads reuse memory from: reuse only
# of dropped mappings, within its cap, and repeated offloaded forwards of layers large enough to use it stay exact;
# the first forward reads each disk layer ahead; examples/big_model_inference.py runs plain (HF) and under the switch.
# Not for: timing (benchmarks/bigmodel_offload.py).
import os
import subprocess
import sys

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import accelerate as hf
import accelerate.big_modeling  # noqa: F401 (hf.big_modeling)
import accelerate.utils as hfu
import accelerate_c as ac
import accelerate_c.big_modeling  # noqa: F401 (ac.big_modeling)
import accelerate_c.utils as acu
from conftest import clean_env

NO_SPLIT = ["LlamaDecoderLayer"]


def _config(tied: bool = False) -> LlamaConfig:
    return LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)


def _empty(lib, tied: bool = False):
    with lib.init_empty_weights():
        model = LlamaForCausalLM(_config(tied))
    if tied:
        model.tie_weights()
    return model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A model saved as one safetensors file and as shards with an index, and its logits on fixed tokens."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(_config()).eval()
    single, sharded = tmp_path_factory.mktemp("single"), tmp_path_factory.mktemp("sharded")
    model.save_pretrained(single)
    model.save_pretrained(sharded, max_shard_size="100KB")
    tokens = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        logits = model(tokens).logits
    return {"single": str(single), "sharded": str(sharded), "tokens": tokens, "logits": logits}


def test_empty_weights_sizes_and_device_maps_match_hf():
    for tied in (False, True):
        m_hf, m_ac = _empty(hf, tied), _empty(ac, tied)
        assert all(p.device.type == "meta" for p in m_ac.parameters())
        assert acu.find_tied_parameters(m_ac) == hfu.find_tied_parameters(m_hf)
        assert dict(acu.compute_module_sizes(m_ac)) == dict(hfu.compute_module_sizes(m_hf))
        for budget in ({"cpu": 200_000}, {"cpu": "300KB"}, {"cpu": 400_000, "disk": 0}, {"cpu": 10**9}):
            for dtype in (None, torch.float16):
                for classes in (NO_SPLIT, None):
                    kw = dict(no_split_module_classes=classes, dtype=dtype)
                    got = acu.infer_auto_device_map(m_ac, max_memory=dict(budget), **kw)
                    want = hfu.infer_auto_device_map(m_hf, max_memory=dict(budget), **kw)
                    assert got == want, (tied, budget, dtype, classes)
        assert acu.get_balanced_memory(m_ac, {"cpu": 10**6}, NO_SPLIT) == hfu.get_balanced_memory(m_hf, {"cpu": 10**6},
                                                                                                NO_SPLIT)
    assert acu.get_max_memory({"cpu": "1GiB", "disk": "2GB"}) == hfu.get_max_memory({"cpu": "1GiB", "disk": "2GB"})
    sizes = hfu.compute_module_sizes(m_hf)
    assert acu.modeling.get_max_layer_size(list(m_ac.named_children()), sizes, NO_SPLIT) == \
        hfu.modeling.get_max_layer_size(list(m_hf.named_children()), sizes, NO_SPLIT)
    dm = {"a.x": "cpu", "a.y": "cpu", "b": "disk", "c.p": 0, "c.q": "cpu"}
    assert acu.modeling.clean_device_map(dict(dm)) == hfu.modeling.clean_device_map(dict(dm))
    for size in ("5GB", "5Gb", "1MiB", "3KB", 7):
        assert acu.convert_file_size_to_int(size) == hfu.convert_file_size_to_int(size)


@pytest.mark.parametrize("kind", ["single", "sharded"])
def test_load_checkpoint_and_dispatch_offloads_and_matches_the_full_model(saved, kind, tmp_path, monkeypatch):
    from accelerate_c.bigmodel import prefetch

    taken = []
    take = prefetch.Prefetcher.take
    monkeypatch.setattr(prefetch.Prefetcher, "take", lambda self, hook: taken.append(take(self, hook)) or taken[-1])
    outs = {}
    for lib in (hf, ac):
        model = _empty(lib)
        folder = tmp_path / lib.__name__
        model = lib.load_checkpoint_and_dispatch(model, saved[kind], device_map="auto", max_memory={"cpu": "300KB"},
                                                 no_split_module_classes=NO_SPLIT, offload_folder=str(folder))
        with torch.no_grad():
            outs[lib.__name__] = [model(saved["tokens"]).logits for _ in range(2)]
        assert "disk" in model.hf_device_map.values() and "cpu" in model.hf_device_map.values()
        if lib is ac:
            dm = model.hf_device_map
            assert os.listdir(folder) == ["index.json"], "disk weights point into the checkpoint, not copies"
            assert all(p.device.type == "meta" for n, p in model.named_parameters() if dm.get(n.split(".")[0]) == "disk"
                       or n.startswith("model.layers"))
    for got in outs["accelerate_c"] + outs["accelerate"]:
        assert torch.equal(got, saved["logits"])
    # the disk-offloaded modules' weights were read ahead (in the background) for most of their forwards
    assert taken and sum(t is not None for t in taken) >= len(taken) // 2, [t is not None for t in taken]


def test_prepare_keeps_a_dispatched_model_where_its_hooks_put_it(saved, tmp_path, clean_state, monkeypatch):
    """A model dispatched over CPU and disk, prepared for evaluation (as the Trainer does with a device-mapped
    model): HF leaves it in place; ours moved it and failed ("can't move a model that has some modules
    offloaded"). verify_device_map answers as HF's; a distributed run refuses such a model with HF's error."""
    outs = {}
    for lib in (hf, ac):
        model = lib.load_checkpoint_and_dispatch(_empty(lib), saved["single"], device_map="auto",
                                                 max_memory={"cpu": "300KB"}, no_split_module_classes=NO_SPLIT,
                                                 offload_folder=str(tmp_path / lib.__name__))
        acc = lib.Accelerator(cpu=True)
        assert acc.verify_device_map(model) and not acc.verify_device_map(torch.nn.Linear(2, 2))
        prepared = acc.prepare_model(model, evaluation_mode=True)
        with torch.no_grad():
            outs[lib.__name__] = prepared(saved["tokens"]).logits
    assert torch.equal(outs["accelerate_c"], saved["logits"]) and torch.equal(outs["accelerate"], saved["logits"])
    monkeypatch.setitem(acc.state.__dict__, "num_processes", 2)  # (the check reads only the process count)
    with pytest.raises(ValueError, match="loaded with `device_map='auto'` in any distributed mode"):
        acc.prepare_model(model, evaluation_mode=True)


def test_offloaded_weights_reached_from_outside_the_forward_match_hf(tmp_path):
    """HF's has_offloaded_params, align_module_device, get_state_dict_offloaded_model and calculate_maximum_sizes
    (missing before) on a Llama dispatched over CPU and disk: the same answers as HF's, the real weights inside the
    context (meta again after it), the whole state dict equal to the model's."""
    device_map = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk",
                  "model.layers.2": "disk", "model.layers.3": "cpu", "model.norm": "cpu", "model.rotary_emb": "cpu",
                  "lm_head": "cpu"}
    for lib, modeling in ((hf, hfu.modeling), (ac, acu.modeling)):
        torch.manual_seed(0)
        model = LlamaForCausalLM(_config())
        ref = {k: v.clone() for k, v in model.state_dict().items()}
        assert modeling.calculate_maximum_sizes(model) == hfu.modeling.calculate_maximum_sizes(model)
        model = lib.dispatch_model(model, device_map=device_map, offload_dir=str(tmp_path / lib.__name__),
                                   main_device="cpu")
        q = model.model.layers[1].self_attn.q_proj
        assert modeling.has_offloaded_params(q) and not modeling.has_offloaded_params(model.model.layers[0].mlp.up_proj)
        with modeling.align_module_device(q):
            assert torch.equal(q.weight, ref["model.layers.1.self_attn.q_proj.weight"])
        assert q.weight.device.type == "meta"
        state = modeling.get_state_dict_offloaded_model(model)
        assert state.keys() == ref.keys() and all(torch.equal(state[k], ref[k]) for k in ref), lib.__name__


class _CastNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.norm = torch.nn.Conv1d(4, 8, 3), torch.nn.LayerNorm(8)
        self.blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU()) for _ in range(2))
        self.head = torch.nn.Linear(8, 3)

    def forward(self, x):
        h = self.norm(self.conv(x).mean(-1).float()).to(x.dtype)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


@pytest.mark.parametrize("skip", [{}, {"skip_modules_pattern": ("head", r"blocks\.1")},
                                  {"skip_modules_classes": (torch.nn.Conv1d,)}], ids=["all", "pattern", "class"])
def test_layerwise_casting_matches_hf(skip):
    """attach_layerwise_casting_hooks (HF 1.15's, missing before): fp8 storage, bf16 compute; the same dtypes stored
    before and after a forward as HF's and, without skips, the same output bits."""
    runs = []
    for lib in (hf, ac):
        torch.manual_seed(0)
        net = _CastNet()
        lib.big_modeling.attach_layerwise_casting_hooks(net, storage_dtype=torch.float8_e4m3fn,
                                                        compute_dtype=torch.bfloat16, **skip)
        stored = {n: p.dtype for n, p in net.named_parameters()}
        with torch.no_grad():
            out = net(torch.randn(2, 4, 10, generator=torch.Generator().manual_seed(1)).bfloat16()) if not skip else None
        runs.append((stored, {n: p.dtype for n, p in net.named_parameters()}, out))
    (hs, ha, ho), (os_, oa, oo) = runs
    assert hs == os_ and ha == oa == hs and torch.float8_e4m3fn in hs.values()
    assert skip or torch.equal(ho, oo)


def test_tied_weights_offloaded_with_the_whole_model(tmp_path):
    """save_pretrained stores one name of a tied pair; with everything on disk the other name must still be found
    (HF 1.15 fails earlier here: "device disk is invalid")."""
    torch.manual_seed(0)
    full = LlamaForCausalLM(_config(tied=True)).eval()
    full.save_pretrained(tmp_path / "ckpt")
    tokens = torch.randint(0, 256, (2, 8))
    with torch.no_grad():
        want = full(tokens).logits
    for budget in ("300KB", "150KB"):
        model = ac.load_checkpoint_and_dispatch(_empty(ac, tied=True), str(tmp_path / "ckpt"), device_map="auto",
                                                max_memory={"cpu": budget}, no_split_module_classes=NO_SPLIT,
                                                offload_folder=str(tmp_path / budget))
        with torch.no_grad():
            assert torch.equal(model(tokens).logits, want), (budget, model.hf_device_map)


def test_offload_helpers_and_hooks_match_hf(saved, tmp_path):
    torch.manual_seed(1)
    base = LlamaForCausalLM(_config()).eval()
    tokens = saved["tokens"]
    with torch.no_grad():
        want = base(tokens).logits
    for lib in (hf, ac):
        for how in ("cpu", "disk", "hook"):
            model = LlamaForCausalLM(_config()).eval()
            model.load_state_dict(base.state_dict())
            if how == "cpu":
                lib.cpu_offload(model, execution_device=torch.device("cpu"))
            elif how == "disk":
                lib.disk_offload(model, str(tmp_path / f"{lib.__name__}_disk"), execution_device=torch.device("cpu"))
            else:
                model, hook = lib.cpu_offload_with_hook(model, execution_device="cpu")
            with torch.no_grad():
                assert torch.equal(model(tokens).logits, want), (lib.__name__, how)
                assert torch.equal(model(tokens).logits, want), (lib.__name__, how)
    # the hooks module: add / chain / remove, as HF's
    calls = []

    import accelerate_c.hooks as hooks

    class Note(hooks.ModelHook):
        def pre_forward(self, module, *args, **kwargs):
            calls.append("pre")
            return args, kwargs

    lin = torch.nn.Linear(3, 3)
    hooks.add_hook_to_module(lin, hooks.ModelHook())
    hooks.add_hook_to_module(lin, Note(), append=True)
    assert isinstance(lin._hf_hook, hooks.SequentialHook) and hasattr(lin, "_old_forward")
    lin(torch.ones(1, 3))
    assert calls == ["pre"]
    hooks.remove_hook_from_module(lin)
    assert not hasattr(lin, "_hf_hook") and not hasattr(lin, "_old_forward")
    lin(torch.ones(1, 3))
    assert calls == ["pre"], "the hook still runs after remove_hook_from_module"


def test_bad_input_names_the_problem_and_loads_nothing(saved, tmp_path):
    model = _empty(ac)
    with pytest.raises(ValueError, match="model.nope"):
        ac.dispatch_model(model, {"": "cpu", "model.nope": "cpu"})
    with pytest.raises(ValueError, match="npu:7|devices that are not there"):
        ac.dispatch_model(model, {"": "npu:7"})
    with pytest.raises(ValueError, match="LlamaDecoderLayer|model.layers.0") as err:
        ac.infer_auto_device_map(model, max_memory={"cpu": 1000}, no_split_module_classes=NO_SPLIT)
    assert "1000" in str(err.value)
    other = LlamaForCausalLM(LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=5,
                                         num_attention_heads=4, num_key_value_heads=2))
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(ValueError) as err:
        ac.load_checkpoint_in_model(other, saved["sharded"])
    text = str(err.value)
    assert "model.layers.4.mlp.up_proj.weight" in text and "model.embed_tokens.weight" in text
    assert "nothing was loaded" in text
    assert all(torch.equal(before[k], v) for k, v in other.state_dict().items()), "half-loaded"
    bin_file = tmp_path / "pytorch_model.bin"
    bin_file.write_bytes(b"not read")
    with pytest.raises(ValueError, match="never pickle"):
        ac.load_checkpoint_in_model(_empty(ac), str(bin_file))


FROM_PRETRAINED = r"""
import sys, torch
from transformers import LlamaForCausalLM
import accelerate
model = LlamaForCausalLM.from_pretrained(sys.argv[1], device_map="auto", max_memory={"cpu": 300_000},
                                         offload_folder=sys.argv[2])
tokens = torch.load(sys.argv[3])
with torch.no_grad():
    logits = model(tokens).logits
ref = torch.load(sys.argv[4])
print("DEVICES", sorted(set(map(str, model.hf_device_map.values()))), "EQUAL", torch.allclose(logits, ref, atol=1e-5),
      "HOOK", type(model.model.layers[3]._hf_hook).__module__, accelerate.__file__)
"""


def test_transformers_from_pretrained_device_map_auto_under_the_switch(saved, tmp_path):
    torch.save(saved["tokens"], tmp_path / "tokens.pt")
    torch.save(saved["logits"], tmp_path / "logits.pt")
    proc = subprocess.run([sys.executable, "-c", FROM_PRETRAINED, saved["sharded"], str(tmp_path / "off"),
                           str(tmp_path / "tokens.pt"), str(tmp_path / "logits.pt")],
                          env=clean_env(ACCELERATE_C_AS_ACCELERATE="1"), cwd="/", capture_output=True, text=True,
                          timeout=300)
    assert "EQUAL True" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "'disk'" in proc.stdout and "HOOK accelerate_c.bigmodel.hooks" in proc.stdout, proc.stdout


def test_region_pool_reuses_only_dropped_mappings_within_its_cap():
    """bigmodel/regions.py: a mapping goes back to the pool when the tensor over it dies, never while it lives, and
    the pool keeps no more than its cap mapped (in use and free)."""
    import gc

    from accelerate_c.bigmodel.regions import GRAIN, RegionPool

    pool = RegionPool(cap=3 * GRAIN)
    a = pool.empty(torch.float32, GRAIN // 4)  # one 2 MiB mapping
    a.fill_(1.0)
    b = pool.empty(torch.float32, GRAIN // 4)
    assert b.data_ptr() != a.data_ptr() and pool.reused == 0
    ptr = a.data_ptr()
    del a
    gc.collect()
    c = pool.empty(torch.float32, GRAIN // 4)
    assert c.data_ptr() == ptr and pool.reused == 1  # the dropped one, not b's
    c.fill_(2.0)
    assert torch.equal(b.fill_(3.0), torch.full_like(b, 3.0)) and torch.equal(c, torch.full_like(c, 2.0))
    big = pool.empty(torch.uint8, 2 * GRAIN + 1)  # 3 mappings' worth: over the cap with b and c in use
    del b, c, big
    gc.collect()
    assert pool._used_bytes == 0 and pool._free_bytes <= pool.cap
    pool.set_cap(0)
    assert pool._free_bytes == 0 and not pool._free
    d = pool.empty(torch.float32, 10)  # a cap of 0 keeps nothing: each mapping is unmapped when its tensor dies
    del d
    gc.collect()
    assert pool._free_bytes == 0 and pool._used_bytes == 0


def test_disk_offloaded_forward_reuses_read_memory_and_stays_exact(tmp_path):
    """Layers large enough for mappings of their own: repeated forwards read each offloaded layer into the memory the
    last layer used (the pool of the prefetcher's loader), and give the full model's logits bitwise every time."""
    cfg = LlamaConfig(vocab_size=256, hidden_size=512, intermediate_size=1536, num_hidden_layers=3,
                      num_attention_heads=8, num_key_value_heads=4)
    torch.manual_seed(0)
    full = LlamaForCausalLM(cfg).eval()
    full.save_pretrained(tmp_path / "ckpt")
    tokens = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        want = full(tokens).logits
    with ac.init_empty_weights():
        model = LlamaForCausalLM(cfg)
    model = ac.load_checkpoint_and_dispatch(model, str(tmp_path / "ckpt"), device_map="auto",
                                            max_memory={"cpu": "20MB"}, no_split_module_classes=NO_SPLIT,
                                            offload_folder=str(tmp_path / "off"))
    assert list(model.hf_device_map.values()).count("disk") >= 2
    pools = {id(h.weights_map.pool): h.weights_map.pool for m in model.modules()
             for h in [getattr(m, "_hf_hook", None)] if getattr(h, "prefetcher", None) is not None}
    assert len(pools) == 1
    pool = next(iter(pools.values()))
    assert pool.cap > 0
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(model(tokens).logits, want)
            assert pool._used_bytes + pool._free_bytes <= pool.cap
    assert pool.reused > 0


def test_first_offloaded_forward_reads_each_layer_ahead(tmp_path):
    """Before any forward has shown the order, the guess is the registration order, where a decoder layer's norms
    come after its linears, although input_layernorm runs first. The prefetcher used to drop its whole queue when the
    module that ran was not at its head, and to guess only past the module that ran: the first disk layer's linears
    (and later whole layers) were read serially. Now every disk linear but the first one to run is read ahead, and
    a module read ahead but not taken in order is still taken later."""
    from accelerate_c.bigmodel import prefetch

    cfg = LlamaConfig(vocab_size=256, hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=4)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path / "ckpt")
    with ac.init_empty_weights():
        model = LlamaForCausalLM(cfg)
    model = ac.load_checkpoint_and_dispatch(model, str(tmp_path / "ckpt"), device_map="auto",
                                            max_memory={"cpu": "20MB"}, no_split_module_classes=NO_SPLIT,
                                            offload_folder=str(tmp_path / "off"))
    names = {id(getattr(m, "_hf_hook", None)): (n, m) for n, m in model.named_modules()}
    taken = []
    take = prefetch.Prefetcher.take

    def spy(self, hook):
        got = take(self, hook)
        taken.append((*names[id(hook)], got is not None))
        return got

    prefetch.Prefetcher.take = spy
    try:
        with torch.no_grad():
            model(torch.randint(0, 256, (2, 16)))
    finally:
        prefetch.Prefetcher.take = take
    linears = [(n, hit) for n, m, hit in taken if isinstance(m, torch.nn.Linear)]
    assert len({n.split(".")[2] for n, _ in linears if n.startswith("model.layers.")}) >= 2, linears
    assert all(hit for _, hit in linears[1:]), linears


def test_big_model_inference_example_runs_unchanged_under_hf_and_ours():
    """examples/big_model_inference.py (issue 23's example) as users run it: plain (HF) and under the switch (ours),
    with layers large enough for the read-ahead's reused mappings; each must print its own package and equal
    logits. It was not run by any test before."""
    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples",
                          "big_model_inference.py")
    for switch, home in (("0", os.sep + "accelerate:"), ("1", os.sep + "accelerate_c:")):
        proc = subprocess.run([sys.executable, script, "--hidden", "512", "--layers", "4"], capture_output=True,
                              text=True, timeout=300, env=clean_env(ACCELERATE_C_AS_ACCELERATE=switch))
        assert proc.returncode == 0, proc.stdout + proc.stderr
        last = proc.stdout.strip().splitlines()[-1]
        assert home in last and "blocks on disk; logits equal the full model's: True" in last, proc.stdout
