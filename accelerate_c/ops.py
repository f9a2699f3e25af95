# accelerate_c/ops.py: the public kernel entry points users call as accelerate_c.ops.* (a face): casts with scale
# and fused amax (precision/cast.py) and the fused gradient passes (optim/gradops.py).
# Not for: imports from inside accelerate_c, which name those modules.
from __future__ import annotations

from .optim.gradops import clip_grad_norm_, global_norm, non_finite_check_and_unscale_, scale_
from .precision.cast import FP8_MAX, cast

__all__ = ["cast", "non_finite_check_and_unscale_", "global_norm", "scale_", "clip_grad_norm_", "FP8_MAX"]
