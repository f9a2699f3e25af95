# The `python -m accelerate_c <command>` CLI: launch, config, env, test, estimate-memory (see cli.py).
# Not for: anything imported by training code at run time, except config_args.ClusterConfig.
