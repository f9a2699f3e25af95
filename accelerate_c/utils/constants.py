# accelerate_c/utils/constants.py: HF 1.15's `accelerate.utils.constants` values that code outside reads
# (transformers' TrainingArguments checks fsdp options against the FSDP lists); the FSDP lists come from the one
# owner, base/fsdp_plugin.py.
# Not for: values of our own (base/settings.py) or behaviour.
from ..base.fsdp_plugin import AUTO_WRAP_POLICIES, SHARDING_STRATEGIES

SCALER_NAME = "scaler.pt"
MODEL_NAME = "pytorch_model"
SAFE_MODEL_NAME = "model"
RNG_STATE_NAME = "random_states"
OPTIMIZER_NAME = "optimizer"
SCHEDULER_NAME = "scheduler"
SAMPLER_NAME = "sampler"
WEIGHTS_NAME = f"{MODEL_NAME}.bin"
WEIGHTS_INDEX_NAME = f"{WEIGHTS_NAME}.index.json"
SAFE_WEIGHTS_NAME = f"{SAFE_MODEL_NAME}.safetensors"
SAFE_WEIGHTS_INDEX_NAME = f"{SAFE_WEIGHTS_NAME}.index.json"
WEIGHTS_PATTERN_NAME = "pytorch_model{suffix}.bin"
SAFE_WEIGHTS_PATTERN_NAME = "model{suffix}.safetensors"
PROFILE_PATTERN_NAME = "profile_{suffix}.json"
FSDP_SHARDING_STRATEGY = list(SHARDING_STRATEGIES)
FSDP_AUTO_WRAP_POLICY = list(AUTO_WRAP_POLICIES)
FSDP_BACKWARD_PREFETCH = ["BACKWARD_PRE", "BACKWARD_POST", "NO_PREFETCH"]
FSDP_STATE_DICT_TYPE = ["FULL_STATE_DICT", "LOCAL_STATE_DICT", "SHARDED_STATE_DICT"]
FSDP_MODEL_NAME = "pytorch_model_fsdp"
TORCH_DYNAMO_MODES = ["default", "reduce-overhead", "max-autotune"]
