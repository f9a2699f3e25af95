# accelerate_c/deepspeed: the DeepSpeed face: DeepSpeedPlugin (plugin.py), the JSON config's schema and its error
# (schema.py), the optimizer/scheduler objects a JSON names (builders.py) and DeepSpeed's fp16 loss-scaler rules
# (loss_scale.py). Runs on accelerate_c's own engines; the deepspeed package is never imported.
# Not for: the sharded engine itself (sharding/).
