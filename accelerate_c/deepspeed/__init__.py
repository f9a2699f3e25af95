# accelerate_c/deepspeed: the DeepSpeed face, bottom to top: the JSON config's schema and its error (schema.py,
# imports nothing else of the package), DeepSpeed's fp16 loss-scaler rules (loss_scale.py), the optimizer /
# scheduler objects a JSON names (builders.py), DeepSpeedPlugin, DummyOptim and DummyScheduler (plugin.py), the
# prepare-time "auto" fills and Dummy replacement (prepare.py), and the face a strategy holds (face.py:
# DeepSpeedFace, NO_DEEPSPEED without a plugin). Runs on accelerate_c's own engines; the deepspeed package is never
# imported.
# Not for: the sharded engine itself (sharding/).
