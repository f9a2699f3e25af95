# tests/scripts/tracking_run.py: trackers, get_logger and profile() on N processes, under HF Accelerate or
# accelerate_c (--impl accelerate|accelerate_c). Each rank writes what it saw to files in --out:
# rank<i>.log (its logger output), order.log (all ranks append: the in_order sequence), state<i>.json
# (trackers held, what get_tracker returned); TensorBoard/JSONL files go to --out/logs, traces to --out/trace.
# Not for: anything but tests/test_tracking.py and tests/test_logging.py.
import argparse
import importlib
import json
import logging
import os
import sys

import torch


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--impl", default="accelerate_c")
    args = p.parse_args()
    acc_mod = importlib.import_module(args.impl)
    get_logger = importlib.import_module(f"{args.impl}.logging").get_logger
    tracking = importlib.import_module(f"{args.impl}.tracking")
    log_with = ["tensorboard", "jsonl"] if args.impl == "accelerate_c" else ["tensorboard"]
    profile = acc_mod.ProfileKwargs(output_trace_dir=os.path.join(args.out, "trace"))
    accelerator = acc_mod.Accelerator(log_with=log_with, project_dir=os.path.join(args.out, "logs"),
                                      kwargs_handlers=[profile])
    rank = accelerator.process_index

    logger = get_logger("tracking_run", log_level="INFO")
    fmt = logging.Formatter("%(levelname)s %(message)s")
    for path, mode in ((os.path.join(args.out, f"rank{rank}.log"), "w"), (os.path.join(args.out, "order.log"), "a")):
        handler = logging.FileHandler(path, mode=mode)
        handler.setFormatter(fmt)
        logger.logger.addHandler(handler)
    logger.logger.propagate = False
    logger.info("main only")
    logger.warning("every rank", main_process_only=False)
    logger.debug("below the level", main_process_only=False)
    for k in range(3):
        logger.info(f"in order {k}", in_order=True)

    accelerator.init_trackers("run", config={"lr": 0.5, "world": accelerator.num_processes})
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    with accelerator.profile():
        for step in range(3):
            loss = model(torch.ones(2, 4)).pow(2).mean()
            # Every rank logs a different value: only rank 0's may reach the files.
            accelerator.log({"loss": loss.item() + rank, "rank": float(rank), "note": f"step {step}"}, step=step)
    tracker = accelerator.get_tracker("tensorboard")
    state = {"n_trackers": len(accelerator.trackers), "names": [t.name for t in accelerator.trackers],
             "get_tracker_blank": type(tracker) is tracking.GeneralTracker}
    with open(os.path.join(args.out, f"state{rank}.json"), "w") as fh:
        json.dump(state, fh)
    accelerator.wait_for_everyone()
    if args.impl == "accelerate":
        for t in accelerator.trackers:
            t.finish()
        # HF 1.15's teardown can abort a gloo rank after all results are written (see parity_train.py).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    accelerator.end_training()


if __name__ == "__main__":
    main()
