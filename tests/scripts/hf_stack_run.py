# tests/scripts/hf_stack_run.py: runs an example script of the HF stack (`examples/hf_trainer.py`, ...) as __main__,
# for tests/test_hf_trainer.py. With `--ours` it turns the switch on in-process (a launched rank already has it from
# `launch --as_accelerate`), so every `import accelerate` of transformers, PEFT and TRL resolves to accelerate_c.
# Not for: test logic.
import runpy
import sys

ours = sys.argv[1] == "--ours"
args = sys.argv[2:] if ours else sys.argv[1:]
if ours:
    import accelerate_c

    accelerate_c.install_as_accelerate()
sys.argv = args
runpy.run_path(args[0], run_name="__main__")
