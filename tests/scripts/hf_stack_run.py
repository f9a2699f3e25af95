# tests/scripts/hf_stack_run.py: runs an example script of the HF stack (`examples/hf_trainer.py`, ...) as __main__,
# for tests/test_hf_trainer.py. With `--ours` it turns the switch on in-process (a launched rank already has it from
# `launch --as_accelerate`) and, while accelerate_c has no ParallelismConfig yet (it arrives with the tensor-parallel
# branch; transformers' TrainingArguments imports it at module level), registers a bare stand-in under
# accelerate_c.parallelism_config, which these scripts never instantiate; it says so on stderr.
# Not for: anything once accelerate_c.parallelism_config exists (the stand-in is then never used).
import dataclasses
import importlib.util
import runpy
import sys
import types

ours = sys.argv[1] == "--ours"
args = sys.argv[2:] if ours else sys.argv[1:]
if ours:
    import accelerate_c

    if importlib.util.find_spec("accelerate_c.parallelism_config") is None:
        @dataclasses.dataclass
        class ParallelismConfig:  # the stand-in: transformers only imports the name in these scripts
            dp_replicate_size: int = 1

        stand_in = types.ModuleType("accelerate_c.parallelism_config")
        stand_in.ParallelismConfig = ParallelismConfig
        sys.modules[stand_in.__name__] = stand_in
        accelerate_c.ParallelismConfig = ParallelismConfig
        print("hf_stack_run: ParallelismConfig stand-in (accelerate_c.parallelism_config not there yet)", file=sys.stderr)
    accelerate_c.install_as_accelerate()
sys.argv = args
runpy.run_path(args[0], run_name="__main__")
