# `python -m accelerate_c <command>`: the CLI entry (launch, config, env, test).
# Not for: library code; see accelerate_c/commands/.
import sys

from accelerate_c.commands.cli import main

if __name__ == "__main__":
    sys.exit(main())
