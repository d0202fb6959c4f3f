"""A run folder someone hands you is data: resuming it runs no code that your configs and command line do not name."""

import pickle
import shutil
import textwrap

import pytest
from omegaconf import OmegaConf

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
