"""How often one runner command composes its config and validates it, in each launching process.

    python bench/probes/compositions.py data.root=../shared/data/mnist trainer.max_steps=2 ...
    torchrun --nproc_per_node 2 bench/probes/compositions.py ... parallel=ddp      # one line per rank

Runs the command as ``runner`` would, counting Hydra's ``ConfigLoaderImpl.load_configuration`` and the runner's
``validate`` calls, and prints ``COUNTS {...}`` to stderr as the process ends.
"""

import atexit
import os
import sys

import hydra._internal.config_loader_impl as loader

import runner.config.check as check
import runner.config.run_spec as run_spec
import runner.config.validation as validation
from runner.cli import main

COUNTS = {"compose": 0, "validate": 0}


def counted(function, name: str):
    def call(*args, **kwargs):
        COUNTS[name] += 1
        return function(*args, **kwargs)

    return call


def report() -> None:
    print("COUNTS", COUNTS, file=sys.stderr, flush=True)


def leave(code: int, exit_now=os._exit) -> None:  # a worker of a process group ends with os._exit
    report()
    exit_now(code)


if __name__ == "__main__":
    loader.ConfigLoaderImpl.load_configuration = counted(loader.ConfigLoaderImpl.load_configuration, "compose")
    validation.validate = check.validate = run_spec.validate = counted(validation.validate, "validate")
    atexit.register(report)
    os._exit = leave
    sys.argv = ["runner", *sys.argv[1:]]
    main()
