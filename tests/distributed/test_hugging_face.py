"""A plain engine script with a Hugging Face model, as Accelerate's docs write it: prepare, backward, step on 2
gloo processes, then ``unwrap_model(model).save_pretrained(...)``; ``from_pretrained`` gives the trained model back."""

import pytest
import torch
from torch.utils.data import DataLoader

from runner.engine import Accelerator, FullyShardedDataParallelPlugin

transformers = pytest.importorskip("transformers")

TINY = {"vocab_size": 256, "n_positions": 32, "n_embd": 32, "n_layer": 2, "n_head": 2}
STEPS = 12


def counting_blocks(n: int = 96, block_size: int = 32) -> list[dict[str, torch.Tensor]]:
    """Blocks of consecutive byte values from random starts: the next token is this one plus 1 (mod 256)."""
    starts = torch.randint(0, 256, (n, 1), generator=torch.Generator().manual_seed(0))
    ids = (starts + torch.arange(block_size)) % 256
    return [{"input_ids": row, "labels": row} for row in ids]


def _train_and_save_pretrained(directory: str, fsdp: bool):
    plugin = FullyShardedDataParallelPlugin(transformer_cls_names_to_wrap=["GPT2Block"]) if fsdp else None
    accelerator = Accelerator(fsdp_plugin=plugin)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**TINY, bos_token_id=None, eos_token_id=None))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = DataLoader(counting_blocks(), batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(1))
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    losses = []
    for _, batch in zip(range(STEPS), loader, strict=False):
        loss = model(**batch).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(accelerator.reduce(loss.detach(), reduction="mean").item())

    unwrapped = accelerator.unwrap_model(model)
    # Under FSDP the parameters are shards: the full state dict is gathered (every rank takes part) and passed.
    state_dict = accelerator.get_state_dict(model) if fsdp else None
    # The tied head is the embedding's tensor in the gathered state dict too, so a save writes it once.
    tied = state_dict["lm_head.weight"] is state_dict["transformer.wte.weight"] if state_dict else None
    unwrapped.save_pretrained(
        directory, is_main_process=accelerator.is_main_process, save_function=accelerator.save, state_dict=state_dict
    )
    accelerator.wait_for_everyone()  # the main process has written the folder

    inputs = torch.stack([block["input_ids"] for block in counting_blocks(8)])
    unwrapped.eval()
    with torch.no_grad():
        trained = unwrapped(input_ids=inputs).logits
    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(directory, output_loading_info=True)
    with torch.no_grad():
        reloaded = loaded.eval()(input_ids=inputs).logits
    return {
        "wrapper": type(model).__name__,
        "unwrapped": type(unwrapped).__name__,
        "losses": losses,
        "loading_info": {key: sorted(map(str, value)) for key, value in info.items()},
        "loaded": type(loaded).__name__,
        "architectures": loaded.config.architectures,
        "max_difference": (trained - reloaded).abs().max().item(),
        "trained_logits": trained,
        "tied": tied,
    }


@pytest.mark.parametrize("fsdp", [False, True], ids=["ddp", "fsdp"])
def test_save_pretrained_of_the_unwrapped_model_loads_with_from_pretrained(launch, tmp_path, fsdp):
    main, other = launch(_train_and_save_pretrained, str(tmp_path / "pretrained"), fsdp)
    if fsdp:  # fully_shard renames the class in place: the unwrapped model is the sharded module itself
        assert (main["wrapper"], main["unwrapped"]) == ("FSDPGPT2LMHeadModel", "FSDPGPT2LMHeadModel")
        assert (main["tied"], other["tied"]) == (True, None)  # gathered to the main process only
    else:
        assert (main["wrapper"], main["unwrapped"]) == ("DistributedDataParallel", "GPT2LMHeadModel")
    assert main["losses"] == other["losses"]
    assert main["losses"][-1] < main["losses"][0] - 0.5, main["losses"]  # it learned (measured: 5.56 -> 4.28)
    files = {path.name for path in (tmp_path / "pretrained").iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors"} <= files
    for result in (main, other):
        assert (result["loaded"], result["architectures"]) == ("GPT2LMHeadModel", ["GPT2LMHeadModel"])
        assert all(not keys for keys in result["loading_info"].values()), result["loading_info"]
        assert result["max_difference"] <= 1e-6
    torch.testing.assert_close(main["trained_logits"], other["trained_logits"], rtol=0, atol=0)  # one model
