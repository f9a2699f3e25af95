# accelerate_c.sharding: the flat-shard engine behind ZeRO 1/2/3 and FSDP (issue 9). config.py holds the one
# configuration object (ShardedConfig) that both faces (FullyShardedDataParallelPlugin and DeepSpeedPlugin /
# DeepSpeed JSON, their YAML blocks, launcher flags and variables) fill; the engine modules (units, flat
# buffers, the strategy in strategies/sharded.py) read only that object.
# Not for: data parallelism without sharding (strategies/ddp*.py) or the checkpoint format (checkpointing/).
