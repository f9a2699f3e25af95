# accelerate_c.sharding: the flat-shard engine behind ZeRO 1/2/3 and FSDP (issue 9). config.py holds the one
# configuration object (ShardedConfig) that both faces (FullyShardedDataParallelPlugin and DeepSpeedPlugin /
# DeepSpeed JSON, their YAML blocks, launcher flags and variables) fill; the engine modules read only that object:
# units.py (which parameters form a unit), flat.py (a unit's flat layout), engine.py (buffers, backward reduction,
# the step's all-gather), zero3.py (stage 3's gather/free hooks), optim_shard.py (the optimizer's shard pieces,
# clipping), comm.py (the counted collectives). The strategy is strategies/sharded.py; docs/sharding.md explains.
# Not for: data parallelism without sharding (strategies/ddp*.py) or the checkpoint format (checkpointing/).
