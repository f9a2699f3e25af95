# tests/scripts/sharded_cases.py: the sharded tests' runs as cases of one process (or one launch of N ranks):
# `sharded_cases.py --cases FILE` (tests/fold.py's Group writes it), each case's args being a kind and its
# arguments: "train" runs sharded_train.py's main(argv) (its --emulate / --one_process references too),
# "pretrained" / "evalmode" / "noinit" the functions of construct_checks.py. fold_cases.py sequences the cases
# (environment, states and communication groups reset between them; the default process group kept). Each case
# is announced on stdout, so a failure names it.
# Not for: the checks (the tests read what each case wrote).
import sys

import construct_checks
import fold_cases
import sharded_train


def case(args: list) -> None:
    kind, argv = args[0], args[1:]
    print(f"=== case {kind} {' '.join(argv)}", flush=True)
    if kind == "train":
        sharded_train.main(argv)
    else:
        getattr(construct_checks, kind)(*argv)


if __name__ == "__main__":
    if sys.argv[1:2] != ["--cases"]:
        raise SystemExit("sharded_cases.py: expected --cases FILE")
    fold_cases.run(case, sys.argv[1:])
