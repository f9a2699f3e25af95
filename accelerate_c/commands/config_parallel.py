# The two parallel-layout blocks of a config file, `parallelism_config` (HF's ParallelismConfig, used with
# `launch --use_parallelism_config` or when the block is not empty) and `megatron_lm_config` (distributed_type:
# MEGATRON_LM, `launch --use_megatron_lm`), with HF 1.15's keys (written prefixed, `parallelism_config_tp_size`,
# `megatron_lm_tp_degree`, as HF's `config` writes them), `launch` flags (--parallelism_config_*, --megatron_lm_*;
# booleans take a value, `--megatron_lm_sequence_parallelism true`) and the variables HF's launcher hands the ranks
# (PARALLELISM_CONFIG_*, MEGATRON_LM_*), which the faces' __post_init__ read. `pp_size` is ours.
# Not for: the faces (base/parallelism_config.py, base/megatron_plugin.py) or the block machinery (config_blocks.py).
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .config_blocks import _Block, env_str, setting

_SIZE = (1, None)


@dataclass
class ParallelismBlock(_Block):
    """`parallelism_config`: the sizes of the layout (PARALLELISM_CONFIG_*)."""
    PREFIX = "parallelism_config_"
    FILE_PREFIX = True
    VALUED_BOOLS = True
    dp_replicate_size: int = setting(1, "int", "data-parallel replicas (DDP)", bounds=_SIZE)
    dp_shard_size: int = setting(1, "int", "data-parallel shards (FSDP)", bounds=_SIZE)
    tp_size: int = setting(1, "int", "tensor-parallel degree", bounds=_SIZE)
    cp_size: int = setting(1, "int", "context-parallel degree (> 1 is not implemented)", bounds=_SIZE)
    cp_backend: str = setting("torch", "str", "context-parallel backend", choices=("torch",))
    cp_comm_strategy: str = setting("allgather", "str", "context-parallel communication (read when cp_size > 1)",
                                    choices=("allgather", "alltoall"))
    sp_size: int = setting(1, "int", "DeepSpeed (Ulysses) sequence-parallel degree (> 1 is not implemented)",
                           bounds=_SIZE)
    sp_backend: str = setting("deepspeed", "str", "sequence-parallel backend", choices=("deepspeed",))
    sp_seq_length: int | None = setting(None, "int", "sequence length (read when sp_size > 1)", bounds=_SIZE)
    sp_seq_length_is_variable: bool = setting(True, "bool", "variable sequence lengths (read when sp_size > 1)")
    sp_attn_implementation: str = setting("sdpa", "str", "attention implementation (read when sp_size > 1)")
    pp_size: int = setting(1, "int", "accelerate_c: pipeline-parallel degree, the outermost dimension", bounds=_SIZE)
    pp_schedule: str = setting("1f1b", "str", "accelerate_c: the pipeline schedule",
                               choices=("gpipe", "1f1b", "interleaved_1f1b", "zb_h1"))
    pp_num_micro_batches: int | None = setting(None, "int", "accelerate_c: micro-batches per batch (default: "
                                               "pp_size)", bounds=_SIZE)
    pp_virtual_stages: int = setting(1, "int", "accelerate_c: stages per rank (interleaved_1f1b)", bounds=_SIZE)

    @classmethod
    def env_of(cls, name: str) -> str:
        return "PARALLELISM_CONFIG_" + name.upper()

    def env(self) -> dict[str, str]:
        """HF's launcher: the sizes and backends always, the CP / SP details only when that dimension is used."""
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "cp_comm_strategy" and self.cp_size <= 1:
                continue
            if f.name.startswith("sp_") and f.name not in ("sp_size", "sp_backend") and self.sp_size <= 1:
                continue
            if f.name.startswith("pp_") and f.name != "pp_size" and (self.pp_size <= 1 or value is None):
                continue
            out[self.env_of(f.name)] = "None" if value is None else env_str(value)
        return out


@dataclass
class MegatronBlock(_Block):
    """`megatron_lm_config`: HF's MegatronLMPlugin settings (MEGATRON_LM_*); see the plugin for the ones
    accelerate_c implements (the others must stay unset or at HF's default)."""
    PREFIX = "megatron_lm_"
    FILE_PREFIX = True
    VALUED_BOOLS = True
    tp_degree: int = setting(1, "int", "tensor-parallel degree", bounds=_SIZE)
    pp_degree: int = setting(1, "int", "pipeline-parallel degree (1F1B schedule)", bounds=_SIZE)
    num_micro_batches: int | None = setting(None, "int", "micro-batches per step (pipeline)", bounds=_SIZE)
    sequence_parallelism: bool | None = setting(None, "bool", "Megatron-SP over the tensor-parallel group")
    gradient_clipping: float = setting(1.0, "float", "global-norm gradient clipping (0 = off)", bounds=(0, None))
    use_custom_fsdp: bool = setting(False, "bool", "not supported (must stay false)")
    no_load_optim: bool | None = setting(None, "bool", "not supported (must stay false)")
    eod_mask_loss: bool | None = setting(None, "bool", "not supported (must stay false)")
    overlap_cpu_optimizer_d2h_h2d: bool | None = setting(None, "bool", "not supported (must stay false)")
    no_save_optim: bool | None = setting(None, "bool", "not supported (must stay false)")
    optimizer_cpu_offload: bool | None = setting(None, "bool", "not supported (must stay false)")
    use_precision_aware_optimizer: bool | None = setting(None, "bool", "not supported (must stay false)")
    decoder_last_pipeline_num_layers: int | None = setting(None, "int", "not supported (must stay unset)")
    recompute_activations: bool | None = setting(None, "bool", "not supported (must stay false)")
    use_distributed_optimizer: bool | None = setting(None, "bool", "not supported (must stay false)")
    recompute_granularity: str | None = setting(None, "str", "not supported (must stay unset or full)")
    recompute_method: str | None = setting(None, "str", "not supported (must stay unset or uniform)")
    recompute_num_layers: int | None = setting(None, "int", "not supported (must stay unset or 1)")
    attention_backend: bool | None = setting(None, "bool", "not supported (must stay unset or true)")
    expert_model_parallel_size: int | None = setting(None, "int", "not supported (must stay unset or 1)")
    context_parallel_size: int | None = setting(None, "int", "not supported (must stay unset, 1 or 2)")
    attention_dropout: float | None = setting(None, "float", "not supported (must stay unset or 0)")
    hidden_dropout: float | None = setting(None, "float", "not supported (must stay unset or 0)")
    attention_softmax_in_fp32: bool | None = setting(None, "bool", "not supported (must stay unset or true)")
    expert_tensor_parallel_size: int | None = setting(None, "int", "not supported (must stay unset or 1)")
    calculate_per_token_loss: bool | None = setting(None, "bool", "not supported (must stay unset or true)")
    use_rotary_position_embeddings: bool | None = setting(None, "bool", "not supported (must stay unset or true)")

    @classmethod
    def env_of(cls, name: str) -> str:
        return "MEGATRON_LM_" + name.upper()
