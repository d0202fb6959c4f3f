"""Record Hugging Face Accelerate's data orders into tests/distributed/data/accelerate_orders.json.

The tests compare ``runner.engine`` with this file; they never import ``accelerate``. To record it again (with
``pip install accelerate``; the file holds the version it was recorded with), on one process and then on two::

    python -m tests.distributed.record_accelerate_orders
    torchrun --nproc_per_node 2 -m tests.distributed.record_accelerate_orders

Each run replaces its own number of processes' records and keeps the others.
"""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import torch.distributed as dist

from tests.distributed.accelerate_orders import REFERENCE, record


def main() -> None:
    import accelerate
    from accelerate import Accelerator, DataLoaderConfiguration
    from accelerate.utils import set_seed

    api = SimpleNamespace(Accelerator=Accelerator, DataLoaderConfiguration=DataLoaderConfiguration, set_seed=set_seed)
    mine = record(api)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size > 1:
        records: list = [None] * world_size
        dist.all_gather_object(records, mine)
    else:
        records = [mine]
    if int(os.environ.get("RANK", "0")) == 0:
        saved = json.loads(REFERENCE.read_text()) if REFERENCE.exists() else {}
        saved["accelerate"] = accelerate.__version__
        saved[str(world_size)] = records
        REFERENCE.parent.mkdir(exist_ok=True)
        REFERENCE.write_text(json.dumps(saved, sort_keys=True) + "\n")
        print(f"wrote {world_size} process(es) of Accelerate {accelerate.__version__} to {REFERENCE}")
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
