# The command-line entry: one argparse parser with a sub-parser per command module, and the single place
# where ConfigError / missing files become a short message and a non-zero exit code.
# Not for: the commands themselves (launch.py, config.py, env.py, test.py, estimate.py, cleanup.py, ...).
from __future__ import annotations

import argparse
import sys

from . import cleanup, config, env, estimate, launch, merge_weights, test
from .config_args import ConfigError
from .estimate import EstimateError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m accelerate_c",
                                     description="accelerate_c command line: launch, config, env, test, "
                                                 "estimate-memory, merge-weights, cleanup")
    sub = parser.add_subparsers(dest="command",
                                metavar="{launch,config,env,test,estimate-memory,merge-weights,cleanup}")
    for module in (launch, config, env, test, estimate, merge_weights, cleanup):
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except (ConfigError, EstimateError) as exc:
        print(f"accelerate_c {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except FileNotFoundError as exc:
        print(f"accelerate_c {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
