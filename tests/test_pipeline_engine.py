# tests/test_pipeline_engine.py: the pipeline engine on one process (pp_size=1, all stages on one rank: every schedule
# still cuts the model into stages, splits the batch into micro-batches and passes activations and gradients between
# stages, locally): the same loss and gradients as the model's own forward and backward on the whole batch, for
# Llama, Mistral (sliding-window mask), Qwen2 and GPT-2 built from a config, with padding and ignored labels, with the
# batch's own num_items_in_batch; activation checkpointing, bf16 autocast, a chain model (nn.Sequential / a
# ModuleList with first/last modules and a loss_fn); gradient accumulation through scale_loss; clip_grad_norm_; the
# stage cuts (balanced by parameter count, user split by index or module name) and the bad-input errors, naming the
# numbers.
# Not for: several processes (test_pipeline_parity.py), schedules alone (test_pipeline_schedules.py).
import pytest
import torch
from torch import nn

from accelerate_c.pipeline import PipelineEngine
from accelerate_c.pipeline import stages as st

transformers = pytest.importorskip("transformers")
VOCAB = 128


def _model(kind: str, layers: int = 4) -> nn.Module:
    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2)
    if kind == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    if kind == "mistral":
        return transformers.MistralForCausalLM(transformers.MistralConfig(sliding_window=6, **common))
    if kind == "qwen2":
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=64, n_layer=layers, n_head=4, n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))


def _batch(rows: int = 8, seq: int = 12, pad: bool = True) -> dict:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (rows, seq), generator=g)
    labels = ids.clone()
    labels[torch.rand(rows, seq, generator=g) < 0.25] = -100
    out = {"input_ids": ids, "labels": labels}
    if pad:
        mask = torch.ones(rows, seq, dtype=torch.long)
        mask[1, -3:] = 0
        mask[5, -5:] = 0
        out["attention_mask"] = mask
    return out


def _grads(model: nn.Module) -> dict:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _reference(kind: str, batch: dict, **kw) -> tuple:
    ref = _model(kind, **kw)
    loss = ref(**batch).loss
    loss.backward()
    return loss.detach(), _grads(ref), ref


def _close(a: dict, b: dict, tol: float = 1e-5) -> None:
    assert set(a) == set(b)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=tol, atol=tol * 1e-2, msg=lambda s: f"{k}: {s}")


@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2", "gpt2"])
@pytest.mark.parametrize("schedule,m,v", [("1f1b", 4, 1), ("zb_h1", 2, 1), ("interleaved_1f1b", 4, 2)])
def test_one_process_equals_the_model(kind, schedule, m, v):
    batch = _batch()
    loss, grads, ref = _reference(kind, batch)
    eng = PipelineEngine(_model(kind), rank=0, size=1, schedule=schedule, num_micro_batches=m, virtual_stages=v)
    out = eng(**batch)
    assert abs(out.loss.item() - loss.item()) <= 1e-6 * loss.item()
    _close(_grads(eng.module), grads)
    eng.eval()
    ref.eval()
    with torch.no_grad():
        got, want = eng(batch), ref(**batch)  # a mapping works as well as keywords
    torch.testing.assert_close(got.logits, want.logits)
    assert got["loss"] is got.loss


def test_num_items_from_the_batch_checkpointing_and_accumulation():
    batch = _batch(pad=False)
    batch2 = {k: v.flip(0) for k, v in batch.items()}
    items = torch.tensor(50)
    ref = _model("llama")
    for b in (batch, batch2):  # Trainer-style: both halves normalised by one count, gradients accumulated
        ref(**b, num_items_in_batch=items).loss.backward()
    eng = PipelineEngine(_model("llama"), rank=0, size=1, schedule="interleaved_1f1b", num_micro_batches=2,
                         virtual_stages=2, activation_checkpointing=[1], track_memory=True)
    for b in (batch, batch2):
        eng(**b, num_items_in_batch=items)
    _close(_grads(eng.module), _grads(ref))
    assert eng.runner.peak_bytes[1] < eng.runner.peak_bytes[0] / 2  # stage 1 recomputes: it keeps only layer inputs
    # HF's gradient_accumulation_steps=2: scale_loss divides each micro-batch's share, sync on the second only
    ref2 = _model("llama")
    for b in (batch, batch2):
        (ref2(**b).loss / 2).backward()
    eng2 = PipelineEngine(_model("llama"), rank=0, size=1, num_micro_batches=4)
    eng2.scale_loss = lambda x: x / 2
    eng2.sync_grads = False
    eng2(**batch)
    eng2.sync_grads = True
    eng2(**batch2)
    _close(_grads(eng2.module), _grads(ref2))
    want = torch.nn.utils.clip_grad_norm_(ref2.parameters(), 0.5)
    got = eng2.clip_grad_norm_(0.5)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    _close(_grads(eng2.module), _grads(ref2))


def test_bf16_autocast():
    batch = _batch()
    ref = _model("llama")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = ref(**batch).loss
    loss.backward()
    eng = PipelineEngine(_model("llama"), rank=0, size=1, schedule="zb_h1", num_micro_batches=2,
                         autocast_dtype=torch.bfloat16)
    out = eng(**batch)
    assert abs(out.loss.item() - loss.item()) <= 1e-2 * loss.item()
    for n, g in _grads(eng.module).items():
        want = dict(ref.named_parameters())[n].grad
        assert (g - want).norm() <= 0.05 * want.norm() + 1e-6, n


def test_chain_models():
    torch.manual_seed(0)
    seq = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 2))
    x, y = torch.randn(8, 6), torch.randn(8, 2)
    ref = nn.Sequential(*[m for m in seq])
    import copy
    ref = copy.deepcopy(seq)
    nn.functional.mse_loss(ref(x), y).backward()
    loss_fn = lambda out, mb: nn.functional.mse_loss(out, mb["target"])  # noqa: E731
    eng = PipelineEngine(seq, rank=0, size=1, schedule="interleaved_1f1b", virtual_stages=5, num_micro_batches=4,
                         loss_fn=loss_fn)
    out = eng(input=x, target=y)
    assert abs(out.loss.item() - nn.functional.mse_loss(ref(x), y).item()) < 1e-6
    _close(_grads(eng.module), _grads(ref))

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp, self.blocks, self.out = nn.Linear(6, 8), nn.ModuleList(nn.Linear(8, 8) for _ in range(4)), \
                nn.Linear(8, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.inp(x)
            for b in self.blocks:
                x = b(x)
            return self.out(x)

    torch.manual_seed(1)
    net = Net()
    ref = copy.deepcopy(net)
    nn.functional.mse_loss(ref(x), y).backward()
    eng = PipelineEngine(net, rank=0, size=1, layers="blocks", first=["inp"], last=["out"], loss_fn=loss_fn,
                         input_key="x", num_micro_batches=2, schedule="zb_h1")
    eng(x=x, target=y)
    _close(_grads(eng.module), _grads(ref))


def test_stage_cuts():
    assert st.balanced([1] * 8, 2) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert st.balanced([1] * 8, 2, first_extra=2) == [[0, 1, 2], [3, 4, 5, 6, 7]]
    assert st.balanced([5, 1, 1, 1, 1, 1], 3) == [[0], [1, 2], [3, 4, 5]]
    assert st.balanced([4, 1, 1, 1, 1, 1, 1, 1], 2, last_extra=3) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert st.plan_stages(6, 3, split=[2, "model.layers.4"], layer_path="model.layers") == [[0, 1], [2, 3], [4, 5]]
    assert st.plan_stages(8, 4, equal=True) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    model = _model("llama")
    from accelerate_c.pipeline.adapters import adapter_for
    plan = adapter_for(model)  # from base_model_pp_plan and the head's _pp_plan
    assert (plan.first, plan.layer_path, plan.last) == (("model.embed_tokens",), "model.layers", ("model.norm", "lm_head"))
    groups = st.tied_groups(_model("gpt2"))
    assert groups == [["transformer.wte.weight", "lm_head.weight"]]
    st.prune(model, "model.layers", {2, 3}, ["model.embed_tokens"])
    names = [n for n, _ in model.named_parameters()]
    assert "model.embed_tokens.weight" not in names and "model.layers.2.mlp.up_proj.weight" in names
    assert not any(n.startswith(("model.layers.0.", "model.layers.1.")) for n in names)
    assert sorted(st.kept_layers(model, "model.layers")) == [2, 3]


def test_bad_input_errors():
    with pytest.raises(ValueError, match=r"8 pipeline stages \(pp_size=2 x 4 virtual stages\) but the model has "
                                         r"only 4 layers \(model.layers\)"):
        PipelineEngine(_model("llama"), rank=0, size=2, schedule="interleaved_1f1b", virtual_stages=4,
                       num_micro_batches=2)
    with pytest.raises(ValueError, match=r"3 pipeline stages but the model has only 2 layers"):
        PipelineEngine(_model("llama", layers=2), rank=0, size=3)
    with pytest.raises(ValueError, match=r"split \[0\] leaves stage 0 empty"):
        PipelineEngine(_model("llama"), rank=0, size=2, split=[0])
    with pytest.raises(ValueError, match=r"split \['model.layers.4'\] leaves stage 1 empty \(its layers would be 4..3"):
        PipelineEngine(_model("llama"), rank=0, size=2, split=["model.layers.4"])
    with pytest.raises(ValueError, match=r"split point 'model.norm' is not a layer of model.layers"):
        PipelineEngine(_model("llama"), rank=0, size=2, split=["model.norm"])
    with pytest.raises(ValueError, match=r"split \[1, 2\] has 2 split points; 2 stages need 1"):
        PipelineEngine(_model("llama"), rank=0, size=2, split=[1, 2])
    with pytest.raises(ValueError, match=r"layers to divide by pp_size x virtual stages: 8 layers \(model.layers\), "
                                         r"6 pipeline stages \(pp_size=2 x 3 virtual stages\)"):
        PipelineEngine(_model("llama", layers=8), rank=0, size=2, schedule="interleaved_1f1b", virtual_stages=3,
                       num_micro_batches=2)
    with pytest.raises(ValueError, match=r"num_micro_batches divisible by pp_size: 3 micro-batches, pp_size=2"):
        PipelineEngine(_model("llama"), rank=0, size=2, schedule="interleaved_1f1b", virtual_stages=2,
                       num_micro_batches=3)
    eng = PipelineEngine(_model("llama"), rank=0, size=1, num_micro_batches=3)
    with pytest.raises(ValueError, match=r"batch size 8 is not divisible by num_micro_batches=3"):
        eng(**_batch())
    with pytest.raises(ValueError, match=r"no pipeline plan for Linear"):
        PipelineEngine(nn.Linear(2, 2), rank=0, size=1)
    with pytest.raises(ValueError, match=r"pipeline rank 2 is not in 0..1 \(pp_size=2\)"):
        PipelineEngine(_model("llama"), rank=2, size=2)
    eng = PipelineEngine(_model("llama"), rank=0, size=1)
    with pytest.raises(ValueError, match="computed no loss: the batch needs labels"):
        eng(input_ids=_batch()["input_ids"])
