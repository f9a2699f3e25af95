# accelerate_c/precision: precision policies (no / fp16 / bf16 autocast and loss scaling: policy.py), fp8 training
# (fp8.py) and the scaled cast kernel they use (cast.py).
# Not for: the optimizer step (strategies/base.py), DeepSpeed's fp16 scaler rules (deepspeed/loss_scale.py).
