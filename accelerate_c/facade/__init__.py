# accelerate_c/facade: the Accelerator and its mixins (run properties, probes, process helpers, checkpoint and
# tracking calls): the one object user code talks to. HF's path for it is accelerate_c.accelerator.
# Not for: deciding anything a strategy, engine or precision owns; it calls them.
