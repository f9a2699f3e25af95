# accelerate_c/ddp: the data-parallel gradient engines: the bucketed flat-buffer all-reduce (bucketed.py) and the
# join agreement shared by every strategy's uneven-input join (join.py).
# Not for: the strategy contract (strategies/ddp.py drives these).
