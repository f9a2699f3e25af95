# accelerate_c/bigmodel: big-model inference (HF 1.15's big_modeling, hooks and modeling utilities): building a model
# without memory (empty.py), sizes and budgets (sizes.py), device maps (device_map.py), the forward hooks
# (hooks.py), offloaded weights (offload.py, prefetch.py), safetensors checkpoints into a placed model
# (checkpoint.py) and placing it (dispatch.py). HF's paths are the faces accelerate_c.big_modeling (dispatch.py),
# accelerate_c.hooks (hooks.py), accelerate_c.utils.modeling and accelerate_c.utils.offload.
# Not for: training (the strategies) or the training checkpoint format (checkpointing/).
