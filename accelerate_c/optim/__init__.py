# accelerate_c.optim: fused CPU optimizers (C kernels, one pass per step over all tensors, multi-threaded).
# Adam/AdamW/SGD are drop-in torch.optim subclasses; fused_step speeds up a plain torch optimizer in place;
# *_flat_ functions serve strategies that own flat buffers. Adam/AdamW(state_dtype=torch.bfloat16 | "8bit") keep
# their moments in bf16 or 8 bits (lowbit.py). Not for: GPU optimizers (those fall back to torch).
from ._fused import fused_step
from .adamw import Adam, AdamW
from .flat import adam_flat_, adamw_flat_, grads_nonfinite, sgd_flat_
from .lowbit import dequantize, quantize, state_dict_to_fp32
from .sgd import SGD

__all__ = ["Adam", "AdamW", "SGD", "fused_step", "adamw_flat_", "adam_flat_", "sgd_flat_", "grads_nonfinite",
           "quantize", "dequantize", "state_dict_to_fp32"]
