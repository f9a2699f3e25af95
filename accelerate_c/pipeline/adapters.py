# accelerate_c/pipeline/adapters.py: how a family of models runs as pipeline stages: which modules the first stage
# holds (the embedding), where the layer list is, which modules the last stage holds (final norm, LM head), and
# what a stage computes around its layers, following the model's own forward:
#   decoder LMs with transformers' base_model_pp_plan (Llama, Mistral, Qwen2, Qwen3): embed_tokens on the first
#     stage; every stage rebuilds, per micro-batch, what the model computes once and threads to all layers (the
#     position ids, the causal mask (sliding-window where the config says so) and the rotary cos/sin: all from the
#     micro-batch's inputs and the hidden state's shape and dtype, so nothing but the hidden state crosses a stage
#     boundary); norm + lm_head + the model's own loss on the last stage;
#   GPT-2 (GPT2LMHeadModel, no pp plan in transformers): wte + wpe (+ token types) + dropout first; h; ln_f + lm_head;
#   a chain (nn.Sequential, or `layers=` a ModuleList path with `first=`/`last=` module paths): each module maps one
#     tensor to one tensor; the batch's `input_key` feeds the first; `loss_fn(output, micro_batch)` gives the loss.
# Losses sum over micro-batches to the whole batch's loss: a causal LM's loss is divided by the batch's count of
# predicted tokens (transformers' num_items_in_batch, taken from the batch when it carries one), so the sum of the
# micro-batch losses (and of their gradients) is what the single process computes on the whole batch; a chain's
# loss_fn is taken as a mean over its micro-batch and weighted by the micro-batch's share of the batch.
# Not for: cutting stages (stages.py), running schedules (runtime.py).
from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import nn

from .stages import get_module

LLAMA_LIKE = ("llama", "mistral", "qwen2", "qwen3")
IGNORE_INDEX = -100


class Adapter:
    layer_path = ""
    first: tuple = ()
    last: tuple = ()
    input_keys: tuple = ("input_ids",)

    def batch_info(self, batch: dict) -> dict:
        return {}

    def embed(self, model: nn.Module, mb: dict) -> torch.Tensor:
        raise NotImplementedError

    def context(self, model: nn.Module, mb: dict, hidden: torch.Tensor) -> dict:
        return {}

    def layer(self, model: nn.Module, idx: int, module: nn.Module, hidden: torch.Tensor, ctx: dict) -> torch.Tensor:
        return module(hidden)

    def head(self, model: nn.Module, hidden: torch.Tensor, mb: dict, info: dict) -> tuple:
        """(the micro-batch's share of the batch loss or None, the outputs (logits))."""
        raise NotImplementedError


def _causal_items(batch: dict) -> Optional[torch.Tensor]:
    """transformers' num_items_in_batch for a causal LM: the batch's (shifted) labels that are not ignored."""
    if batch.get("num_items_in_batch") is not None:
        return batch["num_items_in_batch"]
    if batch.get("shift_labels") is not None:
        return (batch["shift_labels"] != IGNORE_INDEX).sum()
    if batch.get("labels") is None:
        return None
    return (batch["labels"][..., 1:] != IGNORE_INDEX).sum()


class _CausalLM(Adapter):
    def batch_info(self, batch: dict) -> dict:
        return {"num_items": _causal_items(batch)}

    def _loss(self, model: nn.Module, logits: torch.Tensor, mb: dict, info: dict) -> Optional[torch.Tensor]:
        if mb.get("labels") is None and mb.get("shift_labels") is None:
            return None
        kw = {"shift_labels": mb["shift_labels"]} if mb.get("shift_labels") is not None else {}
        return model.loss_function(logits=logits, labels=mb.get("labels"), vocab_size=model.config.vocab_size,
                                   num_items_in_batch=info["num_items"], **kw)


def _positions(mb: dict, hidden: torch.Tensor) -> torch.Tensor:
    if mb.get("position_ids") is not None:
        return mb["position_ids"]
    return torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)


class LlamaLike(_CausalLM):
    """LlamaForCausalLM and the models whose base forward is Llama's (LLAMA_LIKE). The modules come from the config's
    base_model_pp_plan (embed_tokens / layers / norm under the base model's prefix) and the head's _pp_plan."""

    def __init__(self, model: nn.Module) -> None:
        plan = dict(getattr(model.config, "base_model_pp_plan", None) or {})
        if set(plan) != {"embed_tokens", "layers", "norm"}:
            raise ValueError(f"{type(model).__name__}: base_model_pp_plan {sorted(plan)} is not the embed_tokens / "
                             "layers / norm plan the pipeline follows")
        self.base = base = getattr(model, "base_model_prefix", "model") or "model"
        self.layer_path, self.first = f"{base}.layers", (f"{base}.embed_tokens",)
        # the head's plan (the class's: an instance's _pp_plan also lists the base model's modules, prefixed)
        plan_head = getattr(type(model), "_pp_plan", None) or {"lm_head": None}
        head = [k for k in plan_head if not k.startswith(base + ".")]
        self.last = (f"{base}.norm",) + tuple(head)

    def embed(self, model: nn.Module, mb: dict) -> torch.Tensor:
        if mb.get("inputs_embeds") is not None:
            return mb["inputs_embeds"]
        return getattr(model, self.base).embed_tokens(mb["input_ids"])

    def context(self, model: nn.Module, mb: dict, hidden: torch.Tensor) -> dict:
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
        base = getattr(model, self.base)
        cfg = base.config
        pos = _positions(mb, hidden)
        kw = dict(config=cfg, inputs_embeds=hidden, attention_mask=mb.get("attention_mask"), cache=None,
                  position_ids=pos)
        types = getattr(cfg, "layer_types", None)
        masks = {"full_attention": create_causal_mask(**kw)}
        if (types and "sliding_attention" in types) or (not types and getattr(cfg, "sliding_window", None)):
            masks["sliding_attention"] = create_sliding_window_causal_mask(**kw)
        return {"pos": pos, "masks": masks, "types": types,
                "rope": base.rotary_emb(hidden, position_ids=pos)}

    def layer(self, model: nn.Module, idx: int, module: nn.Module, hidden: torch.Tensor, ctx: dict) -> torch.Tensor:
        masks = ctx["masks"]
        kind = ctx["types"][idx] if ctx["types"] else ("sliding_attention" if "sliding_attention" in masks
                                                       else "full_attention")
        return module(hidden, attention_mask=masks[kind], position_embeddings=ctx["rope"], position_ids=ctx["pos"])

    def head(self, model: nn.Module, hidden: torch.Tensor, mb: dict, info: dict) -> tuple:
        logits = model.lm_head(getattr(model, self.base).norm(hidden))
        return self._loss(model, logits, mb, info), logits


class GPT2(_CausalLM):
    layer_path = "transformer.h"
    first = ("transformer.wte", "transformer.wpe", "transformer.drop")
    last = ("transformer.ln_f", "lm_head")

    def embed(self, model: nn.Module, mb: dict) -> torch.Tensor:
        t = model.transformer
        emb = mb["inputs_embeds"] if mb.get("inputs_embeds") is not None else t.wte(mb["input_ids"])
        hidden = emb + t.wpe(_positions(mb, emb))
        if mb.get("token_type_ids") is not None:
            hidden = hidden + t.wte(mb["token_type_ids"])
        return t.drop(hidden)

    def context(self, model: nn.Module, mb: dict, hidden: torch.Tensor) -> dict:
        from transformers.masking_utils import create_causal_mask
        pos = _positions(mb, hidden)
        am = mb.get("attention_mask")
        if am is not None and am.ndim < 4:
            am = am.view(hidden.shape[0], -1)
        mask = create_causal_mask(config=model.transformer.config, inputs_embeds=hidden, attention_mask=am,
                                  cache=None, position_ids=pos)
        return {"pos": pos, "mask": mask}

    def layer(self, model: nn.Module, idx: int, module: nn.Module, hidden: torch.Tensor, ctx: dict) -> torch.Tensor:
        return module(hidden, None, ctx["mask"], None, encoder_attention_mask=None, use_cache=False,
                      position_ids=ctx["pos"])

    def head(self, model: nn.Module, hidden: torch.Tensor, mb: dict, info: dict) -> tuple:
        logits = model.lm_head(model.transformer.ln_f(hidden))
        return self._loss(model, logits, mb, info), logits


class Chain(Adapter):
    """Modules that each map one tensor to one tensor (see the header)."""

    def __init__(self, layer_path: str, first: tuple, last: tuple, loss_fn: Optional[Callable],
                 input_key: str) -> None:
        self.layer_path, self.first, self.last = layer_path, tuple(first), tuple(last)
        self.loss_fn, self.input_keys = loss_fn, (input_key,)

    def batch_info(self, batch: dict) -> dict:
        return {"rows": int(batch[self.input_keys[0]].shape[0])}

    def embed(self, model: nn.Module, mb: dict) -> torch.Tensor:
        hidden = mb[self.input_keys[0]]
        for path in self.first:
            hidden = get_module(model, path)(hidden)
        return hidden

    def head(self, model: nn.Module, hidden: torch.Tensor, mb: dict, info: dict) -> tuple:
        for path in self.last:
            hidden = get_module(model, path)(hidden)
        if self.loss_fn is None:
            return None, hidden
        share = hidden.shape[0] / info["rows"]
        return self.loss_fn(hidden, mb) * share, hidden


def adapter_for(model: nn.Module, *, layers: Optional[str] = None, first: tuple = (), last: tuple = (),
                loss_fn: Optional[Callable] = None, input_key: str = "input") -> Adapter:
    """The adapter of `model` (see the header); a model it does not know is an error naming its class."""
    if layers is not None or isinstance(model, nn.Sequential):
        return Chain(layers or "", first, last, loss_fn, input_key)
    cfg: Any = getattr(model, "config", None)
    mtype = getattr(cfg, "model_type", None)
    if mtype in LLAMA_LIKE and hasattr(model, "lm_head") and hasattr(getattr(model, "model", None), "layers"):
        return LlamaLike(model)
    if mtype == "gpt2" and hasattr(model, "lm_head") and hasattr(getattr(model, "transformer", None), "h"):
        return GPT2()
    raise ValueError(f"no pipeline plan for {type(model).__name__} (model_type={mtype!r}): known are the causal LMs "
                     f"of {', '.join(LLAMA_LIKE + ('gpt2',))}; for another model give layers='<ModuleList path>', "
                     "first=/last= module paths and loss_fn (each module mapping one tensor to one tensor)")
