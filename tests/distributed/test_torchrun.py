"""A plain script under torchrun on a CPU-only machine really runs distributed."""

import json
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import json, sys
    import torch
    from torch.utils.data import DataLoader, TensorDataset
    from runner.engine import Accelerator

    accelerator = Accelerator()
    loader = accelerator.prepare(DataLoader(TensorDataset(torch.arange(10)), batch_size=2))
    mine = [int(i) for (batch,) in loader for i in batch]
    seen = accelerator.gather_for_metrics(torch.tensor(mine)).tolist()
    if accelerator.is_main_process:
        print(json.dumps({"world": accelerator.num_processes, "type": accelerator.distributed_type.value,
                          "mine": mine, "seen": seen}))
    """
)


def test_torchrun_script_joins_one_group(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["world"] == 2 and report["type"] == "MULTI_CPU"
    # Rank 0's batch of each global batch of 4, the short last one's included (rank 1's is padding, as in
    # Accelerate): distinct samples, not a copy.
    assert report["mine"] == [0, 1, 4, 5, 8, 9]
    # Gathered after the loop, the padding stays (as in Accelerate): rank 1's last batch is the epoch's first two.
    assert sorted(report["seen"]) == sorted([*range(10), 0, 1])
