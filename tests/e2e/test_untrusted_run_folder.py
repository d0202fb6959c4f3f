"""A run folder someone hands you is data: resuming it runs no code that your configs and command line do not name."""

import json
import logging
import pickle
import shutil
import socket
import subprocess
import sys
import textwrap
import time
import urllib.request

import pytest
from omegaconf import OmegaConf

from runner.config.resume import find_checkpoint
from runner.folders.provenance import key_path
from tests.e2e.conftest import metrics, mnist_args, run_cli, run_cli_refusals
from tests.unit.engine.checkpoint.checkpoint_edits import rewrite_manifest

NET = """
    from torch import nn


    class Net(nn.Module):
        def __init__(self, channels: int = 8, hidden: int = 32, dropout: float = 0.0):
            super().__init__()
            self.layers = nn.Sequential(nn.Flatten(), nn.Linear(784, hidden), nn.ReLU(), nn.Linear(hidden, 10))

        def forward(self, images):
            return self.layers(images)
"""
COMMON = [*mnist_args("test[:256]", "test[9900:]"), "trainer.checkpoint_every_n_steps=2", "tracker=none"]


class _CreatesMarker:
    """A pickle that, once loaded, creates the file it names."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


@pytest.fixture(scope="module")
def own_run(tmp_path_factory):
    """A run of the user's own model, named on its command line (no config group names it)."""
    here = tmp_path_factory.mktemp("project")
    (here / "mylab").mkdir()
    (here / "mylab" / "__init__.py").write_text(textwrap.dedent(NET))
    run = here / "run"
    started = run_cli(*COMMON, "model._target_=mylab.Net", "trainer.max_steps=2", f"hydra.run.dir={run}", cwd=here)
    assert started.returncode == 0, started.stderr[-2000:]
    return here, run


def _their_copy(here, run, name, **model):
    """A copy of ``run``, its newest checkpoint, and that checkpoint's config with ``model`` in it."""
    theirs = here / name
    shutil.copytree(run, theirs)
    checkpoint = max((theirs / "checkpoints").iterdir(), key=lambda folder: int(folder.name.split("_")[1]))
    config = OmegaConf.load(checkpoint / "config.yaml")
    if model:
        config.model = model
    return theirs, checkpoint, config


def test_your_own_run_resumes_and_anyone_elses_is_refused_before_its_code_is_imported(own_run):
    here, run = own_run
    resumed = run_cli(f"resume={run}", "trainer.max_steps=4", cwd=here)  # signed by this user: no flag needed
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert metrics(run)["step"] == 4
    assert (
        "trainer.max_steps is 4 now and was 2 when the run started: the learning-rate schedule is rebuilt for 4 "
        "steps, so the rates from here on follow the new length."
    ) in resumed.stdout  # the run's log

    markers = {name: here / f"{name}.ran" for name in ("hub", "pickle", "package", "recipe", "callback", "resolver")}
    hub, hub_checkpoint, config = _their_copy(
        here, run, "hub", _target_="torch.hub.load", repo_or_dir="${project.project_dir}", model="net", source="local"
    )
    OmegaConf.save(config, hub_checkpoint / "config.yaml")
    (hub / "hubconf.py").write_text(f"def net(**kwargs):\n    open({str(markers['hub'])!r}, 'w').close()\n"
                                    "    from mylab import Net\n    return Net(hidden=128)\n")  # fmt: skip
    rewrite_manifest(hub_checkpoint, relist=["config.yaml"])

    pickled, pickled_checkpoint, config = _their_copy(
        here, run, "pickled", _target_="torch.load", f="${project.project_dir}/net.pkl", weights_only=False
    )
    OmegaConf.save(config, pickled_checkpoint / "config.yaml")
    (pickled / "net.pkl").write_bytes(pickle.dumps(_CreatesMarker(markers["pickle"])))
    rewrite_manifest(pickled_checkpoint, relist=["config.yaml"])

    # A run folder that is also a package beside the command's folder, its recipe a module inside it.
    package, package_checkpoint, config = _their_copy(here, run, "evilrun")
    config.recipe = "evilrun.steal"
    OmegaConf.save(config, package_checkpoint / "config.yaml")
    (package / "__init__.py").write_text(f"open({str(markers['package'])!r}, 'w').close()\n")
    (package / "steal.py").write_text(f"def train(cfg, accelerator):\n    open({str(markers['recipe'])!r}, 'w')\n")
    rewrite_manifest(package_checkpoint, relist=["config.yaml"])

    # Code hidden in the saved command line (a Hydra callback, a node as a value) or in a resolver.
    callback, callback_checkpoint, _ = _their_copy(here, run, "callback")
    (callback / "hubconf.py").write_text(f"def net(**kwargs):\n    open({str(markers['callback'])!r}, 'w').close()\n")
    hub_node = f"{{_target_:torch.hub.load,repo_or_dir:{callback},model:net,source:local}}"
    saved = OmegaConf.to_container(OmegaConf.load(callback_checkpoint / "overrides.yaml"))
    saved += [f"++hydra.callbacks.evil={hub_node}", f"+metrics.evil={hub_node}"]
    OmegaConf.save(OmegaConf.create(saved), callback_checkpoint / "overrides.yaml")
    rewrite_manifest(callback_checkpoint, relist=["overrides.yaml"])
    resolver, resolver_checkpoint, config = _their_copy(here, run, "resolver")
    (resolver / "hubconf.py").write_text(f"def net(**kwargs):\n    open({str(markers['resolver'])!r}, 'w').close()\n")
    config.metrics = {"evil": "${oc.create:'" + hub_node.replace(str(callback), str(resolver)) + "'}"}
    OmegaConf.save(config, resolver_checkpoint / "config.yaml")
    rewrite_manifest(resolver_checkpoint, relist=["config.yaml"])

    someone_else = {"RUNNER_HOME": str(here / "another_users_home")}
    cases = [  # (folder, what its config and saved command line name that this user's configs do not)
        (run, "model._target_=mylab.Net"),  # your run, in another user's hands
        (hub, "model._target_=torch.hub.load, model._target_=mylab.Net"),
        (pickled, "model._target_=torch.load, model._target_=mylab.Net"),
        (package, "model._target_=mylab.Net, recipe=evilrun.steal"),
        (callback, "model._target_=mylab.Net, hydra.callbacks.evil._target_=torch.hub.load, metrics.evil._target_="
         "torch.hub.load"),
        (resolver, "model._target_=mylab.Net, metrics.evil uses the resolver oc.create"),
    ]  # fmt: skip
    results = run_cli_refusals([[f"resume={folder}"] for folder, _ in cases], cwd=here, env=someone_else)
    for (folder, named), result in zip(cases, results, strict=True):
        last = result["stderr"].strip().splitlines()[-1]
        assert result["returncode"] == 2, result["stderr"][-2000:]
        assert last.startswith(f"runner: error: resume={folder}: {folder}/checkpoints/checkpoint_") and (
            f"was not written by you (it carries no signature of your key {here / 'another_users_home'}" in last
        ), last
        assert f"that your config groups and this command line do not ({named}); resuming would run it" in last
        assert last.endswith("so read that code first and add trust_resume=true to accept it."), last
        assert "Traceback" not in result["stderr"]
    assert not [marker for marker in markers.values() if marker.exists()]

    # Deliberately accepted, the folder's code is what runs (the attack was real), and the run goes on.
    trusted = run_cli(f"resume={hub}", "trust_resume=true", "trainer.max_steps=6", cwd=here, env=someone_else)
    assert trusted.returncode == 0, trusted.stderr[-2000:]
    assert markers["hub"].exists() and metrics(hub)["step"] == 6


class MLflowServer:
    """A real MLflow tracking server on loopback (one worker process, not its default four), its access log kept: a
    request it was sent shows there."""

    def __init__(self, folder):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = folder / "server.log"
        command = [
            sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(self.port), "--workers", "1",
            "--backend-store-uri", f"sqlite:///{folder / 'store.db'}", "--default-artifact-root", str(folder / "art"),
        ]  # fmt: skip
        with open(self.log, "w") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=folder)

    def wait_ready(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.process.poll() is None, self.log.read_text()[-2000:]
            try:
                urllib.request.urlopen(f"{self.url}/health", timeout=2).close()
                return
            except OSError:
                time.sleep(0.3)
        raise AssertionError(f"the MLflow server did not start: {self.log.read_text()[-2000:]}")

    def requests(self) -> list[str]:
        """Every request the server logged."""
        return [line for line in self.log.read_text().splitlines() if '"GET ' in line or '"POST ' in line]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """Started first, so that it comes up while the module's run trains."""
    pytest.importorskip("mlflow")
    server = MLflowServer(tmp_path_factory.mktemp("mlflow_server"))
    yield server
    server.process.terminate()
    server.process.wait(timeout=30)


def _foreign(here, run, name, edit, *, tracker="none"):
    """A copy of ``run`` whose newest checkpoint's config ``edit`` changed (and its saved command line chose
    ``tracker``), its manifest digests recomputed: what anyone could make of a folder (the manifest's digest is not
    keyed; only your signature is)."""
    folder, checkpoint, config = _their_copy(here, run, name)
    plain = OmegaConf.to_container(config)
    edit(plain)
    OmegaConf.save(OmegaConf.create(plain), checkpoint / "config.yaml")
    saved = OmegaConf.to_container(OmegaConf.load(checkpoint / "overrides.yaml"))
    saved = [f"tracker={tracker}" if line == "tracker=none" else line for line in saved]
    OmegaConf.save(OmegaConf.create(saved), checkpoint / "overrides.yaml")
    rewrite_manifest(checkpoint, relist=["config.yaml", "overrides.yaml"])
    return folder, checkpoint


def test_a_foreign_folder_reaches_no_code_environment_or_server_that_you_did_not_name(mlflow_server, own_run):
    here, run = own_run
    mlflow = pytest.importorskip("mlflow")
    marker = here / "unpickled.ran"
    (here / "notes.pkl").write_bytes(pickle.dumps(_CreatesMarker(marker)))

    def getter(config):  # the tokenizer of a text dataset, fetched by path: pandas.read_pickle of their file
        config["data"]["eval"] = {
            "_target_": "runner.data.Packed", "block_size": 4, "dataset": [f"{here}/notes.pkl"],
            "tokenizer": {"_target_": "hydra.utils.get_object", "path": "pandas.read_pickle"},
        }  # fmt: skip
        config["data"]["eval_transform"] = {"_target_": "hydra.utils.get_object", "_args_": ["os.system"]}

    def tracked(uri, **extra):
        mlflow_node = {"tracking_uri": uri, "experiment_name": "runner", "run_name": None, "group": None,
                       "tags": {}, "log_model": True}  # fmt: skip
        return lambda config: config.update(tracker={"mlflow": {**mlflow_node, **extra}})

    got, got_checkpoint = _foreign(here, run, "getter", getter)
    server, server_checkpoint = _foreign(here, run, "server", tracked(mlflow_server.url), tracker="mlflow")
    token, token_checkpoint = _foreign(
        here, run, "token", tracked(f"sqlite:///{here / 'token' / 'mlflow.db'}", tags={"t": "${oc.env:HF_TOKEN,none}"})
    )
    online, online_checkpoint = _foreign(
        here, run, "online", lambda c: c.update(tracker={"wandb": {"project": "runner", "mode": "online"}})
    )
    rendezvous, rendezvous_checkpoint = _foreign(
        here, run, "rendezvous", lambda c: c["trainer"].update(rdzv_endpoint="127.0.0.1:29400")
    )
    beacon, beacon_checkpoint = _foreign(here, run, "beacon", lambda c: c.update(notes="https://127.0.0.1:9/b.png"))
    mlflow_server.wait_ready()
    before = len(mlflow_server.requests())

    url = mlflow_server.url
    mine = "model._target_=mylab.Net"  # typed: this user's own code, so that what follows is what is refused
    someone_else = {"RUNNER_HOME": str(here / "another_users_home"), "HF_TOKEN": "hf_victims_secret_token"}
    cases = [
        ([f"resume={got}", mine], got_checkpoint, "names code",
         "(data.eval.tokenizer.path=pandas.read_pickle, data.eval_transform._args_[0]=os.system)"),
        ([f"resume={server}", mine], server_checkpoint, "reaches", f"(tracker.mlflow.tracking_uri={url})"),
        (["eval", str(server), mine], server_checkpoint, "reaches", f"(tracker.mlflow.tracking_uri={url})"),
        ([f"resume={token}", mine], token_checkpoint, "reaches", "(tracker.mlflow.tags.t uses the resolver oc.env)"),
        ([f"resume={online}", mine], online_checkpoint, "reaches", "(tracker.wandb.mode=online)"),
        ([f"resume={rendezvous}", mine], rendezvous_checkpoint, "reaches", "(trainer.rdzv_endpoint=127.0.0.1:29400)"),
        ([f"resume={beacon}", mine], beacon_checkpoint, "reaches", "(notes=https://127.0.0.1:9/b.png)"),
    ]  # fmt: skip
    results = run_cli_refusals([argv for argv, *_ in cases], cwd=here, env=someone_else)
    for (argv, checkpoint, why, named), result in zip(cases, results, strict=True):
        last = result["stderr"].strip().splitlines()[-1]
        assert result["returncode"] == 2 and "Traceback" not in result["stderr"], result["stderr"][-2000:]
        asked = f"runner eval {argv[1]}" if argv[0] == "eval" else argv[0]
        assert last.startswith(f"runner: error: {asked}: {checkpoint} was not written by you (it carries no "), last
        if why == "names code":
            assert f"names code that your config groups and this command line do not {named}; " in last, last
        else:
            assert f"and its config reaches past the folder {named}; " in last, last
            assert last.endswith(
                "would read your environment or send the run there, so give each of those keys on this command line "
                "(the value you want, or null) to accept or replace it."
            ), last
    assert not marker.exists()
    assert mlflow_server.requests()[before:] == []  # not even the reachability check's /health

    # A colleague's finished run on that server, which the folder's trackers.json names.
    client = mlflow.MlflowClient(mlflow_server.url)
    colleague = client.create_run(client.create_experiment("colleague")).info.run_id
    client.set_terminated(colleague)
    (server / "trackers.json").write_text(
        json.dumps({"mlflow": {"run_id": colleague, "tracking_uri": mlflow_server.url}})
    )
    # Given on the command line, the destination is the user's: the run goes there, as a run of its own.
    resumed = run_cli(
        f"resume={server}", mine, f"tracker.mlflow.tracking_uri={mlflow_server.url}", "tracker.mlflow.log_model=false",
        "trainer.max_steps=6", cwd=here, env=someone_else,
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "the trackers start new runs rather than continuing those trackers.json names" in resumed.stdout
    untouched = client.get_run(colleague)
    assert (untouched.data.params, untouched.data.metrics, untouched.info.status) == ({}, {}, "FINISHED")
    (new,) = client.search_runs([client.get_experiment_by_name("runner").experiment_id])
    assert new.info.run_id != colleague and new.data.params["trainer.max_steps"] == "6"
    assert new.data.metrics["eval/loss"] > 0 and "hf_victims_secret_token" not in json.dumps(new.data.params)
    assert json.loads((server / "trackers.json").read_text())["mlflow"]["run_id"] == new.info.run_id


def test_a_checkpoint_of_yours_changed_after_it_was_saved_is_damaged(own_run, caplog):
    here, run = own_run
    edited = here / "edited"
    shutil.copytree(run, edited)
    newest, previous = sorted((edited / "checkpoints").iterdir(), key=lambda f: int(f.name.split("_")[1]))[-1:-3:-1]
    rewrite_manifest(newest, lambda manifest: manifest.update(step=manifest["step"] + 100))  # self-consistent
    with caplog.at_level(logging.WARNING, logger="runner"):
        assert find_checkpoint(str(edited)) == (edited.resolve(), previous.resolve())
    assert caplog.messages == [
        f"Skipping {newest.name}: signature.json was made with your key ({key_path()}) for other contents of "
        "config.yaml, overrides.yaml and manifest.json: the checkpoint was changed after it was saved, so it is "
        "treated as damaged"
    ]
    (result,) = run_cli_refusals([[f"resume={newest}"]], cwd=here)
    assert result["returncode"] == 2 and result["stderr"].strip().splitlines()[-1] == (
        f"runner: error: resume={newest}: signature.json was made with your key ({key_path()}) for other contents "
        "of config.yaml, overrides.yaml and manifest.json: the checkpoint was changed after it was saved, so it is "
        "treated as damaged; resume an earlier checkpoint, or the run folder, which skips it."
    )
    (training,) = run_cli_refusals([["eval", str(run), "evaluate_only=false"]], cwd=here)
    assert training["returncode"] == 2 and training["stderr"].strip() == (
        "runner: error: runner eval only evaluates, so evaluate_only=false is not an option of it; to train the run "
        f"further, resume it: runner resume={run}."
    )
