"""A Hugging Face ``datasets.Dataset`` through the engine on 2 gloo processes: sharded, every row once, resumed
exactly, and split between processes as a ``Dataset``."""

import pytest
import torch

datasets = pytest.importorskip("datasets", reason="the hf extra (datasets) is not installed")

ROWS = 37  # 4 global batches of 8 and a short one of 5, padded to 8 for 2 ranks (a whole batch of 4 each)


def _table() -> "datasets.Dataset":
    return datasets.Dataset.from_dict({"id": list(range(ROWS)), "x": [[float(i), -float(i)] for i in range(ROWS)]})


def _loaders(project_dir: str, stop_after: int | None = None, resume: bool = False) -> dict:
    from torch.utils.data import DataLoader

    from runner.engine import Accelerator, ProjectConfiguration

    accelerator = Accelerator(project_config=ProjectConfiguration(project_dir, automatic_checkpoint_naming=True))
    table = _table().with_format("torch")
    train = DataLoader(table, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(3))
    evaluation = DataLoader(table, batch_size=4)
    train, evaluation = accelerator.prepare(train, evaluation)
    if resume:
        accelerator.load_state()
    epochs, seen = [], 0
    while train.iteration < 2:
        epoch = train.iteration
        for batch in train:
            assert set(batch) == {"id", "x"} and batch["x"].shape == (len(batch["id"]), 2)
            ids = accelerator.gather(batch["id"]) if accelerator.num_processes > 1 else batch["id"]
            epochs.append((epoch, ids.tolist()))
            seen += 1
            if seen == stop_after:
                accelerator.save_state()
                return {"train": epochs}
    gathered = [accelerator.gather_for_metrics(batch["id"]).tolist() for batch in evaluation]
    with accelerator.split_between_processes(_table(), apply_padding=True) as mine:
        share = (type(mine).__name__, mine["id"])
    return {"train": epochs, "eval": [i for ids in gathered for i in ids], "share": share}


def test_a_datasets_table_hands_out_every_row_once_per_epoch_and_resumes_exactly(launch, tmp_path):
    full = launch(_loaders, str(tmp_path / "full"))
    for rank in full:
        for epoch in (0, 1):
            rows = [i for e, ids in rank["train"] if e == epoch for i in ids]
            # The short last global batch is padded by three rows from the epoch's start (even_batches).
            assert len(rows) == ROWS + 3 and sorted(set(rows)) == list(range(ROWS)), epoch
        assert sorted(rank["eval"]) == list(range(ROWS))  # gather_for_metrics drops the padding: each row once
    assert full[0]["train"] == full[1]["train"]  # gathered: both ranks saw the same global batches
    orders = [[i for e, ids in full[0]["train"] if e == epoch for i in ids] for epoch in (0, 1)]
    assert orders[0] != orders[1]  # a new shuffle each epoch
    assert full[0]["share"] == ("Dataset", list(range(19)))
    assert full[1]["share"] == ("Dataset", [*range(19, 37), 36])  # padded with its last row

    first = launch(_loaders, str(tmp_path / "cut"), 7)  # 2 batches into epoch 1
    rest = launch(_loaders, str(tmp_path / "cut"), None, True)
    assert first[0]["train"] + rest[0]["train"] == full[0]["train"]
