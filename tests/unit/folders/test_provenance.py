import os
import stat

import pytest
from omegaconf import OmegaConf

from runner.config import CONF_DIR, ConfigError
from runner.folders.provenance import (
    check_resumable,
    command_line_names,
    installed_names,
    key_path,
    saved_names,
    sign,
    signed_by_you,
    targets_in,
)

CONFIG = {
    "recipe": "supervised",
    "model": {"_target_": "runner.models.MnistCNN", "channels": 8},
    "optimizer": {"_target_": "torch.optim.AdamW", "_partial_": True, "lr": 1e-3},
    "data": {"train": {"_target_": "runner.data.MNIST", "transforms": [{"_target_": "mylab.Flip"}]}, "eval": None},
    "metrics": {},
}


def _checkpoint(folder, config=CONFIG, overrides=()):
    folder.mkdir(parents=True)
    OmegaConf.save(OmegaConf.create(config), folder / "config.yaml")
    OmegaConf.save(OmegaConf.create(list(overrides)), folder / "overrides.yaml")
    return folder


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("RUNNER_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def test_a_signature_holds_only_for_this_users_key_and_these_exact_files(tmp_path, home, monkeypatch):
    checkpoint = _checkpoint(tmp_path / "checkpoint_0")
    assert not signed_by_you(checkpoint)  # no signature yet
    sign(checkpoint)
    assert key_path() == home / "signing.key"
    assert stat.S_IMODE(os.stat(key_path()).st_mode) == 0o600
    assert signed_by_you(checkpoint)

    (checkpoint / "overrides.yaml").write_text("- model._target_=torch.hub.load\n")
    assert not signed_by_you(checkpoint)  # any edit breaks it
    sign(checkpoint)
    monkeypatch.setenv("RUNNER_HOME", str(tmp_path / "someone_else"))
    assert not signed_by_you(checkpoint)  # another user's key


def test_the_names_of_code_are_read_at_any_depth_and_from_the_saved_overrides(tmp_path):
    assert list(targets_in(CONFIG)) == [
        ("model", "runner.models.MnistCNN"),
        ("optimizer", "torch.optim.AdamW"),
        ("data.train", "runner.data.MNIST"),
        ("data.train.transforms[0]", "mylab.Flip"),
    ]
    checkpoint = _checkpoint(tmp_path / "c", overrides=["+loss._target_=evil.Loss", "recipe=evil.recipe", "seed=1"])
    names = saved_names(checkpoint)
    assert ("recipe", "supervised", "recipe=supervised") in names
    assert names[-2:] == [
        ("target", "evil.Loss", "loss._target_=evil.Loss"),
        ("recipe", "evil.recipe", "recipe=evil.recipe"),
    ]


def test_installed_configs_and_the_command_line_name_their_code():
    targets, recipes = installed_names([CONF_DIR])
    assert {"runner.models.MnistCNN", "runner.models.GPT", "torch.optim.AdamW", "runner.data.MNIST"} <= targets
    assert {"torchmetrics.classification.MulticlassAccuracy", "torch.nn.CrossEntropyLoss"} <= targets
    assert {"supervised", "language_model", "recipes.supervised"} <= recipes
    assert "torch.hub.load" not in targets

    typed = command_line_names(
        ["model._target_=mylab.Net", "+data.train={_target_: mylab.Data, n: 3}", "recipe=mylab.loop", "seed=3"]
    )
    assert typed == ({"mylab.Net", "mylab.Data"}, {"mylab.loop"})


def test_a_folder_someone_else_wrote_may_name_only_the_code_your_configs_and_command_line_name(tmp_path, home):
    hub = {**CONFIG, "model": {"_target_": "torch.hub.load", "repo_or_dir": "${project.project_dir}", "model": "cnn"}}
    hub["data"] = {"train": {"_target_": "runner.data.MNIST"}, "eval": None}
    checkpoint = _checkpoint(tmp_path / "checkpoint_3", hub, overrides=["recipe=theirs.recipe"])
    with pytest.raises(ConfigError) as error:
        check_resumable(checkpoint, path="their_run", overrides=[], search_path=[])
    assert str(error.value) == (
        f"resume=their_run: {checkpoint} was not written by you (it carries no signature of your key "
        f"{home / 'signing.key'}) and names code that your config groups and this command line do not "
        "(model._target_=torch.hub.load, recipe=theirs.recipe); resuming would run it, so read that code first and "
        "add trust_resume=true to accept it."
    )
    # Typed on this command line, the same names are the user's own choice; so is trust_resume=true.
    check_resumable(
        checkpoint, path="r", overrides=["model._target_=torch.hub.load", "recipe=theirs.recipe"], search_path=[]
    )
    check_resumable(checkpoint, path="r", overrides=["trust_resume=true"], search_path=[])
    with pytest.raises(ConfigError):
        check_resumable(checkpoint, path="r", overrides=["trust_resume=true", "trust_resume=false"], search_path=[])

    sign(checkpoint)  # the same folder, written by this user: resumes without a word
    check_resumable(checkpoint, path="r", overrides=[], search_path=[])


def test_code_from_the_hub_runs_only_where_this_command_line_asks_for_it(tmp_path, home):
    model = {"_target_": "runner.models.MnistCNN", "trust_remote_code": True, "hub": {"trust_remote_code": "${x}"}}
    checkpoint = _checkpoint(
        tmp_path / "checkpoint_0",
        {**CONFIG, "model": model, "data": {"train": {"_target_": "runner.data.MNIST", "trust_remote_code": False}}},
        overrides=[
            "+optimizer.trust_remote_code=true",
            "+loss={_target_: torch.nn.CrossEntropyLoss, trust_remote_code: 1}",
        ],
    )
    with pytest.raises(ConfigError) as error:
        check_resumable(checkpoint, path="r", overrides=[], search_path=[])
    assert "(model.trust_remote_code=true, model.hub.trust_remote_code=${x}, optimizer.trust_remote_code=true, " in str(
        error.value
    )
    assert "loss.trust_remote_code=1)" in str(error.value)  # false (data.train's) is never named
    typed = ["model.trust_remote_code=true", "model.hub.trust_remote_code=true", "optimizer.trust_remote_code=true"]
    with pytest.raises(ConfigError, match=r"\(loss.trust_remote_code=1\)"):
        check_resumable(checkpoint, path="r", overrides=typed, search_path=[])
    check_resumable(checkpoint, path="r", overrides=[*typed, "loss.trust_remote_code=1"], search_path=[])


def test_a_config_folder_on_the_search_path_names_its_targets(tmp_path, home):
    conf = tmp_path / "conf" / "model"
    conf.mkdir(parents=True)
    (conf / "net.yaml").write_text("_target_: mylab.models.Net\nwidth: 4\n")
    config = {**CONFIG, "model": {"_target_": "mylab.models.Net"}, "data": {"train": {"_target_": "runner.data.MNIST"}}}
    checkpoint = _checkpoint(tmp_path / "checkpoint_0", config)
    with pytest.raises(ConfigError, match=r"\(model._target_=mylab.models.Net\)"):
        check_resumable(checkpoint, path="r", overrides=[], search_path=[])
    check_resumable(checkpoint, path="r", overrides=[], search_path=[f"file://{tmp_path / 'conf'}"])


HUB = "{_target_: torch.hub.load, repo_or_dir: ., model: net, source: local}"


@pytest.mark.parametrize(
    ("config", "overrides", "named"),
    [
        (CONFIG, [f"++hydra.callbacks.evil={HUB}"], "hydra.callbacks.evil._target_=torch.hub.load"),
        (CONFIG, [f"+metrics.evil={HUB}"], "metrics.evil._target_=torch.hub.load"),
        (CONFIG, ["model._target_=torch.hub.load,mylab.Net"], "model._target_=torch.hub.load"),
        ({**CONFIG, "metrics": {"evil": "${oc.create:'" + HUB + "'}"}}, [], "metrics.evil uses the resolver oc.create"),
        (CONFIG, ["data.root=${oc.decode:'{a: 1}'}"], "uses the resolver oc.decode"),
        (CONFIG, ["model=[unclosed"], "model=[unclosed"),
    ],
    ids=["hydra-callback", "dict-value", "sweep", "resolver-in-config", "resolver-in-override", "unparsed"],
)
def test_code_named_anywhere_in_the_saved_config_or_overrides_is_found(tmp_path, home, config, overrides, named):
    checkpoint = _checkpoint(tmp_path / "run" / "checkpoints" / "checkpoint_0", config, overrides)
    with pytest.raises(ConfigError) as error:
        check_resumable(checkpoint, path="r", overrides=[], search_path=[])
    assert named in str(error.value)


def test_damaged_config_files_and_a_command_run_inside_their_folder_are_refused(tmp_path, home, monkeypatch):
    run = tmp_path / "run"
    plain = {**CONFIG, "data": {"train": {"_target_": "runner.data.MNIST"}, "eval": None}}
    checkpoint = _checkpoint(run / "checkpoints" / "checkpoint_0", plain)
    (checkpoint / "overrides.yaml").write_text("'+metrics.evil={_target_: torch.hub.load}': 1\n")  # a mapping
    with pytest.raises(ConfigError) as error:
        check_resumable(checkpoint, path="r", overrides=[], search_path=[])
    assert str(error.value) == (
        f"{checkpoint / 'overrides.yaml'} is not a list of overrides; the checkpoint is damaged, so resume another one."
    )
    (checkpoint / "overrides.yaml").write_text("[]\n")
    check_resumable(checkpoint, path="r", overrides=[], search_path=[])
    monkeypatch.chdir(run / "checkpoints")  # Python would import the folder's own modules first
    with pytest.raises(ConfigError) as error:
        check_resumable(checkpoint, path=".", overrides=[], search_path=[])
    assert str(error.value) == (
        f"resume=.: {run} was not written by you and this command runs inside it, where Python imports the folder's "
        f"own modules first; run it from outside the folder (cd {tmp_path})."
    )


def test_a_key_others_can_read_or_that_is_a_link_signs_nothing(tmp_path, home):
    checkpoint = _checkpoint(tmp_path / "checkpoint_0")
    sign(checkpoint)
    assert signed_by_you(checkpoint)
    os.chmod(key_path(), 0o644)
    assert not signed_by_you(checkpoint)
    os.chmod(key_path(), 0o600)
    key_path().rename(tmp_path / "elsewhere.key")
    key_path().symlink_to(tmp_path / "elsewhere.key")
    assert not signed_by_you(checkpoint)


def test_a_foreign_configs_destinations_are_refused_unless_local_or_typed(tmp_path):
    from runner.folders.foreign_config import destinations, environment_reads, installed_values

    run = tmp_path / "sweep" / "3"
    installed = installed_values([CONF_DIR])
    local = {"tracker": {"mlflow": {"tracking_uri": f"sqlite:///{run / 'mlflow.db'}", "group": "theirs"}}}
    assert destinations(local, run_dir=run, typed=[], installed=installed) == []  # the folder's own store
    sweep = {"tracker": {"mlflow": {"tracking_uri": f"sqlite:///{run.parent / 'mlflow.db'}"}}}
    assert destinations(sweep, run_dir=run, typed=[], installed=installed) == []  # its sweep's
    elsewhere = {"tracker": {"mlflow": {"tracking_uri": f"sqlite:///{tmp_path / 'other' / 'mlflow.db'}"}}}
    assert destinations(elsewhere, run_dir=run, typed=[], installed=installed) == [
        f"tracker.mlflow.tracking_uri=sqlite:///{tmp_path / 'other' / 'mlflow.db'}"
    ]
    # A destination you type is yours; the folder's names in it must be your configs' values, or typed too.
    wandb = {"tracker": {"wandb": {"mode": "online", "project": "runner", "entity": "their-team", "log_model": True}}}
    assert destinations(wandb, run_dir=run, typed=[], installed=installed) == ["tracker.wandb.mode=online"]
    typed = ["tracker.wandb.mode"]
    assert destinations(wandb, run_dir=run, typed=typed, installed=installed) == ["tracker.wandb.entity=their-team"]
    assert destinations(wandb, run_dir=run, typed=[*typed, "tracker.wandb"], installed=installed) == []
    offline = {"tracker": {"wandb": {"mode": "offline", "entity": "their-team"}}}
    assert destinations(offline, run_dir=run, typed=[], installed=installed) == []  # nothing leaves the machine

    config = {
        "tracker": {"mlflow": {"tags": {"t": "${oc.env:HF_TOKEN}", "when": "${now:%H}"}}},
        "x": "${hydra:runtime.cwd}",
    }
    assert environment_reads(config, ["data.root=${oc.env:DATA}"], typed=["x"]) == [
        "tracker.mlflow.tags.t uses the resolver oc.env",
        "data.root uses the resolver oc.env",
    ]  # x is replaced by the command line; now reads only the clock
