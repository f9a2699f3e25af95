# accelerate_c.tensor_parallel: the tensor- and sequence-parallel engine (Megatron-style) over an explicit collective
# group: apply_tensor_parallel slices a model in place from a plan (transformers' tp_plan or {pattern: style}); the
# layers (linear.py, vocab.py) communicate through the group only (comm.py); state.py gives the logical layout of the
# slices, the full state dict and the gradient norm over the group. docs/parallelism.md ("The TP engine").
# Not for: choosing the degrees or building the groups (the layout object), wrapping data parallelism around it
# (the strategies), the checkpoint files (checkpointing/).
from .apply import TPSlice, apply_tensor_parallel, tp_state
from .comm import TPComm
from .plan import STYLES, model_plan
from .state import (broadcast_replicated, checkpoint_slices, clip_grad_norm_, gather_full_state_dict, grad_norm,
                    init_rng, tensor_slices, tp_layout)
from .vocab import vocab_parallel_cross_entropy

__all__ = ["STYLES", "TPComm", "TPSlice", "apply_tensor_parallel", "broadcast_replicated", "checkpoint_slices",
           "clip_grad_norm_",
           "gather_full_state_dict", "grad_norm", "init_rng", "model_plan", "tensor_slices", "tp_layout", "tp_state",
           "vocab_parallel_cross_entropy"]
