# accelerate_c/runtime: the process's runtime state and what reads it: PartialState / AcceleratorState (state.py),
# GradientState (gradient.py), collective helpers on it (operations.py), RNG (random.py), memory helpers, logging,
# progress bars, model unwrapping (models.py). HF's paths for them are accelerate_c.state / .logging / .utils.*.
# Not for: strategies or engines (they sit above and read the state).
