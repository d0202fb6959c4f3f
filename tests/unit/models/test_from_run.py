"""runner.models.from_run: a declared model takes the weights of a run, a checkpoint or a weights folder, or one
sentence says why not. (A Hugging Face run fine-tuned from another, end to end: tests/e2e/test_hugging_face.py.)"""

import json
import math
import os
import resource
import shutil
import struct
import time

import pytest
import torch
from hydra.utils import instantiate
from safetensors.torch import save_file
from torch import nn

from runner.engine import Accelerator, ProjectConfiguration
from runner.engine.checkpoint.serialization import save_model_files
from runner.models import from_run


class Tied(nn.Module):
    def __init__(self, width=8):
        super().__init__()
        self.embed = nn.Embedding(16, width)
        self.head = nn.Linear(width, 16, bias=False)
        self.head.weight = self.embed.weight
        self.vocab_size = 16


def trained(seed: int) -> Tied:
    torch.manual_seed(seed)
    return Tied()


def same(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))


def test_weights_come_from_a_weights_folder_a_finished_runs_model_or_an_unfinished_runs_newest_checkpoint(tmp_path):
    source = trained(1)
    save_model_files(source.state_dict(), tmp_path / "exported")  # the tied head stored once
    loaded = from_run(tmp_path / "exported", Tied())
    assert same(loaded, source) and loaded.head.weight is loaded.embed.weight
    (tmp_path / "cached").mkdir()  # Hugging Face's cache: the snapshot's files are links to its blobs, copied first
    (tmp_path / "cached" / "model.safetensors").symlink_to(tmp_path / "exported" / "model.safetensors")
    with pytest.raises(ValueError) as refused:
        from_run(tmp_path / "cached", Tied())
    cached, blob = tmp_path / "cached" / "model.safetensors", tmp_path / "exported" / "model.safetensors"
    assert str(refused.value) == (
        f"{cached} is a symbolic link (to {blob}); a run folder holds no links, so remove it or copy the run with "
        "links resolved (cp -rL)."
    )
    shutil.copytree(tmp_path / "cached", tmp_path / "copied")  # cp -rL: the links' files, copied
    assert same(from_run(tmp_path / "copied", Tied()), source)

    run = tmp_path / "run"  # an unfinished run: checkpoints only
    accelerator = Accelerator(project_config=ProjectConfiguration(str(run), automatic_checkpoint_naming=True))
    prepared = accelerator.prepare(trained(2))
    accelerator.save_state()
    with torch.no_grad():
        prepared.embed.weight.add_(1.0)
    accelerator.save_state()  # the newest: this one
    assert same(from_run(run, Tied()), prepared)
    assert same(from_run(run / "checkpoints" / "checkpoint_0", Tied()), trained(2))

    save_model_files(trained(3).state_dict(), run / "model")  # now finished: its final model wins
    assert same(from_run(str(run), Tied()), trained(3))


def test_the_yaml_form_builds_the_model_node_then_loads(tmp_path):
    save_model_files(nn.Linear(2, 3).state_dict(), tmp_path / "w")
    node = {"_target_": "runner.models.from_run", "source": str(tmp_path / "w"),
            "model": {"_target_": "torch.nn.Linear", "in_features": 2, "out_features": 3}}  # fmt: skip
    model = instantiate(node)
    assert isinstance(model, nn.Linear) and torch.equal(model.weight, from_run(tmp_path / "w", nn.Linear(2, 3)).weight)
    with torch.device("meta"):  # the launcher's check of the config: the folder is read, nothing loads
        assert instantiate(node).weight.is_meta


def test_what_from_run_reads_is_said_in_its_node_by_the_runner(tmp_path):
    from omegaconf import OmegaConf

    from runner.models.run_weights import reading

    gone = {"_target_": "runner.models.from_run", "source": str(tmp_path / "gone"),
            "model": {"_target_": "torch.nn.Linear", "in_features": 2, "out_features": "${width}"}}  # fmt: skip
    cfg = OmegaConf.create({"width": 3, "model": {"_target_": "torch.nn.Sequential", "_args_": [gone, gone]}})
    resumed = reading(cfg.model, "checkpoint")  # a resume: the checkpoint loaded next holds every weight
    assert [arg.reads for arg in resumed._args_] == ["checkpoint", "checkpoint"] and "reads" not in cfg.model._args_[0]
    assert [layer.out_features for layer in instantiate(resumed)] == [3, 3]  # built; the folder was never read
    from hydra.errors import InstantiationException

    with pytest.raises(InstantiationException, match=f"{tmp_path / 'gone'} does not exist; pass a run folder"):
        instantiate(reading(cfg.model, "check"))  # the launcher's check: the source must exist, nothing is read
    with pytest.raises(ValueError, match="^from_run's reads='all' is not one of source, checkpoint, check; leave"):
        from_run(tmp_path, nn.Linear(2, 3), reads="all")


def test_every_refusal_is_one_sentence(tmp_path):
    save_model_files(trained(1).state_dict(), tmp_path / "tied")
    (tmp_path / "empty").mkdir()
    (tmp_path / "pickled").mkdir()
    (tmp_path / "pickled" / "pytorch_model.bin").write_bytes(b"not read")
    (tmp_path / "truncated").mkdir()
    (tmp_path / "truncated" / "model.safetensors").write_bytes(b"xx")
    for name, shard in [("outside", "../tied/model.safetensors"), ("indexed_pickle", "pytorch_model.bin")]:
        (tmp_path / name).mkdir()
        (tmp_path / name / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": shard}}))
        (tmp_path / name / "pytorch_model.bin").write_bytes(b"never unpickled")
    (tmp_path / "piped").mkdir()
    (tmp_path / "piped" / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "a.safetensors"}}))
    os.mkfifo(tmp_path / "piped" / "a.safetensors")  # reading it would wait forever
    damaged = "holds weights that cannot be read ({}); they are damaged, so write them again or point at a checkpoint."
    cases = [
        (tmp_path / "missing", Tied(), f"{tmp_path / 'missing'} does not exist; pass a run folder or a checkpoint "
         "folder (checkpoints/checkpoint_N)."),
        (tmp_path / "empty", Tied(), f"{tmp_path / 'empty'} holds no model.safetensors, no checkpoint and no run; "
         "pass a weights folder, a run folder or a checkpoint folder (checkpoints/checkpoint_N)."),
        (tmp_path / "pickled", Tied(), f"{tmp_path / 'pickled'} holds pickled weights (.bin), which are never "
         "unpickled here; convert them to safetensors (save_pretrained(..., safe_serialization=True)) or point at a "
         "run or checkpoint folder."),
        (tmp_path / "tied", Tied(width=4), f"The weights in {tmp_path / 'tied'} are not Tied's (other shapes: "
         "embed.weight (16, 8) for (16, 4), head.weight (16, 8) for (16, 4)); point model.source at a run of this "
         "model, or build the model its weights were saved from."),
        (tmp_path / "tied", nn.Linear(8, 16), f"The weights in {tmp_path / 'tied'} are not Linear's (missing: "
         "weight, bias; unexpected: embed.weight, head.weight); point model.source at a run of this model, or "
         "build the model its weights were saved from."),
        (tmp_path / "tied", "Tied", "from_run's model is str, not a torch module; give it a model node."),
        (tmp_path / "truncated", Tied(), f"{tmp_path / 'truncated'} " + damaged.format(
            "SafetensorError: Error while deserializing header: header too small")),
        (tmp_path / "outside", Tied(), f"{tmp_path / 'outside'} " + damaged.format(
            "ValueError: model.safetensors.index.json names '../tied/model.safetensors', not a .safetensors file in "
            "this folder")),
        (tmp_path / "indexed_pickle", Tied(), f"{tmp_path / 'indexed_pickle'} " + damaged.format(
            "ValueError: model.safetensors.index.json names 'pytorch_model.bin', not a .safetensors file in this "
            "folder")),
        (tmp_path / "piped", Tied(), f"{tmp_path / 'piped'} " + damaged.format(
            "ValueError: a.safetensors is not a regular file (a pipe or a device, which reading would wait on)")),
    ]  # fmt: skip
    for source, model, sentence in cases:
        with pytest.raises(ValueError) as refused:
            from_run(source, model)
        assert str(refused.value) == sentence
    with pytest.raises(ValueError) as refused:
        from_run(tmp_path / "tied", Tied(), vocab_size=65)  # the language model recipe passes its data's
    assert str(refused.value) == "The data needs vocab_size=65, and model.model builds Tied with vocab_size=16; set " \
        "model.model.vocab_size=65."  # fmt: skip


def test_strict_false_loads_what_fits_and_leaves_the_rest(tmp_path):
    class Wider(Tied):
        def __init__(self):
            super().__init__()
            self.extra = nn.Linear(2, 2)

    save_model_files(trained(1).state_dict(), tmp_path)
    torch.manual_seed(5)
    model = Wider()
    before = model.extra.weight.clone()
    with pytest.raises(ValueError, match=r"are not Wider's \(missing: extra.weight, extra.bias\)"):
        from_run(tmp_path, Wider())
    from_run(tmp_path, model, strict=False)
    assert torch.equal(model.embed.weight, trained(1).embed.weight) and torch.equal(model.extra.weight, before)


def write_declared(path, tensors: dict[str, list[int]], metadata: dict[str, str] | None = None) -> None:
    """A float32 safetensors file as its header declares ``tensors`` (name -> shape), written by hand: the 8-byte
    header length, the JSON header, then the tensors' bytes as a hole (a sparse file), never written."""
    header, offset = ({"__metadata__": metadata} if metadata else {}), 0
    for name, shape in tensors.items():
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + 4 * math.prod(shape)]}
        offset += 4 * math.prod(shape)
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    with open(path, "wb") as file:
        file.write(struct.pack("<Q", len(encoded)) + encoded)
        file.truncate(8 + len(encoded) + offset)


HUGE = [5_000_000_000]  # 20 GB of float32


def test_names_and_shapes_are_compared_from_the_header_before_any_tensor_is_read(tmp_path):
    for name, tensors in [("renamed", {"weight": [3, 2], "bias": [3], "huge": HUGE}),
                          ("reshaped", {"weight": HUGE, "bias": [3]})]:  # fmt: skip
        (tmp_path / name).mkdir()
        write_declared(tmp_path / name / "model.safetensors", tensors)
    assert (tmp_path / "renamed" / "model.safetensors").stat().st_size > 20e9  # as declared, though a hole on disk
    peak, start = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, time.monotonic()
    for name, found in [("renamed", "unexpected: huge"), ("reshaped", "other shapes: weight (5000000000,) for (3, 2)")]:
        with pytest.raises(ValueError) as refused:
            from_run(tmp_path / name, nn.Linear(2, 3))
        assert str(refused.value) == (
            f"The weights in {tmp_path / name} are not Linear's ({found}); point model.source at a run of this model, "
            "or build the model its weights were saved from."
        )
    model = from_run(tmp_path / "renamed", nn.Linear(2, 3), strict=False)  # what fits is read, and nothing else
    assert torch.equal(model.weight, torch.zeros(3, 2)) and torch.equal(model.bias, torch.zeros(3))
    assert time.monotonic() - start < 10
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak < 200_000  # kB: far from the 20 GB declared


ALIASES_DAMAGED = "the file is damaged, so write it again or load a different one."


@pytest.mark.parametrize(
    ("aliases", "problem"),
    [
        ('{"head.weight": "gone"}', "maps 'head.weight' to 'gone', a tensor the file does not hold"),
        ('{"embed.weight": "embed.weight"}', "maps 'embed.weight', a tensor the file holds itself, to 'embed.weight'"),
        ('{"head.weight": ["embed.weight"]}', "is not a JSON object of tensor names (name -> stored name)"),
        ("[]", "is not a JSON object of tensor names (name -> stored name)"),
        ("{", "is not a JSON object of tensor names (name -> stored name)"),
        ("[" * 100_000, "is not a JSON object of tensor names (name -> stored name)"),
    ],
)
def test_aliases_that_name_no_tensor_of_the_file_are_one_sentence(tmp_path, aliases, problem):
    weights = tmp_path / "model.safetensors"
    save_file({"embed.weight": torch.ones(16, 8)}, weights, metadata={"format": "pt", "aliases": aliases})
    with pytest.raises(ValueError) as refused:
        from_run(tmp_path, Tied())
    assert str(refused.value) == f"{weights}: its aliases metadata {problem}; {ALIASES_DAMAGED}"


def test_a_link_where_the_weights_are_is_one_sentence(tmp_path):
    run = tmp_path / "run"
    accelerator = Accelerator(project_config=ProjectConfiguration(str(run), automatic_checkpoint_naming=True))
    accelerator.prepare(trained(1))
    accelerator.save_state()
    save_model_files(trained(2).state_dict(), tmp_path / "elsewhere")
    (run / "model").symlink_to(tmp_path / "elsewhere")  # the run's final model, a folder of someone else's
    linked = (
        f"{run / 'model'} is a symbolic link (to {tmp_path / 'elsewhere'}); a run folder holds no links, so remove it "
        "or copy the run with links resolved (cp -rL)."
    )
    for source in (run, run / "model", run / "checkpoints" / "checkpoint_0"):  # the run, or a folder of it, named
        with pytest.raises(ValueError) as refused:
            from_run(source, Tied())
        assert str(refused.value) == linked
    (run / "model").unlink()
    shutil.copytree(tmp_path / "elsewhere", run / "model")
    os.link(run / "model" / "model.safetensors", tmp_path / "another-name")  # the same file, named outside the run
    hard = (
        f"{run / 'model' / 'model.safetensors'} is a hard link (its file has 2 names, any of them perhaps outside the "
        "run); a run folder holds only files of its own, so copy the run with cp -r, which writes each file anew, "
        "and point at the copy."
    )
    for source in (run, run / "model"):
        with pytest.raises(ValueError) as refused:
            from_run(source, Tied())
        assert str(refused.value) == hard
    shutil.rmtree(run / "model")
    checkpoint = run / "checkpoints" / "checkpoint_0"
    os.link(checkpoint / "model.safetensors", tmp_path / "checkpoint-weights")
    with pytest.raises(ValueError) as refused:
        from_run(run, Tied())
    assert str(refused.value) == hard.replace(str(run / "model"), str(checkpoint))


def test_a_dcp_checkpoint_reads_only_the_tensors_the_model_takes(tmp_path):
    import pickle
    import warnings

    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorStorageMetadata

    from runner.engine import FullyShardedDataParallelPlugin
    from tests.unit.engine.checkpoint.checkpoint_edits import rewrite_manifest

    config = ProjectConfiguration(str(tmp_path), automatic_checkpoint_naming=True)
    accelerator = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(), project_config=config)
    torch.manual_seed(4)
    source = nn.Linear(2, 3)
    expected = {name: tensor.clone() for name, tensor in source.state_dict().items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP's own notes on one process
        accelerator.prepare(source)
        accelerator.save_state()
    checkpoint = tmp_path / "checkpoints" / "checkpoint_0"
    metadata_path = checkpoint / "model" / ".metadata"
    metadata = pickle.loads(metadata_path.read_bytes())
    weight = metadata.state_dict_metadata["model.weight"]
    size = torch.Size(HUGE)  # 20 GB of float32, declared by the metadata and pointing into a file of a few bytes
    metadata.state_dict_metadata["model.huge"] = TensorStorageMetadata(
        weight.properties, size, [ChunkStorageMetadata(torch.Size([0]), size)]
    )
    shard = next(iter(metadata.storage_data.values())).relative_path
    metadata.storage_data[MetadataIndex("model.huge", torch.Size([0]), 0)] = _StorageInfo(shard, 0, 4 * HUGE[0])
    metadata_path.write_bytes(pickle.dumps(metadata))
    rewrite_manifest(checkpoint, relist=["model/.metadata"])

    with pytest.raises(ValueError, match=r"are not Linear's \(unexpected: huge\)"):
        from_run(checkpoint, nn.Linear(2, 3))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    model = from_run(checkpoint, nn.Linear(2, 3), strict=False)  # the huge tensor is neither allocated nor read
    assert torch.equal(model.weight, expected["weight"]) and torch.equal(model.bias, expected["bias"])
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak < 200_000  # kB
