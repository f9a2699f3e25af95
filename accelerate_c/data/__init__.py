# accelerate_c/data: the prepared-dataloader machinery (sharding samplers, loader classes, resume state,
# prepare_data_loader / skip_first_batches). `accelerate_c.data_loader` re-exports it under HF's names.
# Not for: collectives (runtime/operations.py).
