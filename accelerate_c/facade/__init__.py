# accelerate_c/facade: the Accelerator and its mixins (run properties, probes, process helpers, checkpoint and
# tracking calls): the one object user code talks to. HF's path for it is accelerate_c.accelerator. fsdp_checkpoint.py:
# HF's utils.fsdp_utils (what transformers' Trainer calls to save and load under FSDP), over the Accelerator's calls.
# Not for: deciding anything a strategy, engine or precision owns; it calls them.
