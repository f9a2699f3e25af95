# tests/scripts/dynamo_inductor.py: test_dynamo.py's training loop with prepare() compiling the model on inductor,
# in a process of its own so that inductor's C++ builds and caches land where the test says (TORCHINDUCTOR_CACHE_DIR;
# some of its folders are fixed when torch._inductor is first imported). Writes the losses and parameters to argv[1].
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from test_dynamo import _train  # noqa: E402

from accelerate_c.utils.other import is_compiled_module  # noqa: E402

model, same, losses, params = _train(dynamo_backend="inductor")
torch.save({"compiled": is_compiled_module(model), "same": same, "losses": losses, "params": params}, sys.argv[1])
