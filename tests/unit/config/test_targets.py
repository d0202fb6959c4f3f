"""runner.config.targets: every `_target_` imports and accepts its keys, or one sentence says what to fix."""

from __future__ import annotations

import importlib
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from runner.config import ConfigError
from runner.config.targets import check_targets, locate

MODELS = """
    VERSION = "1"


    class TinyMLP:
        def __init__(self, in_features: int, hidden: int = 32, classes: int = 10):
            self.in_features, self.hidden, self.classes = in_features, hidden, classes

        @classmethod
        def from_width(cls, width: int, *, classes: int = 10):
            return cls(width, width, classes)


    class Resize:
        def __init__(self, size: int):
            self.size = size


    def collate(batch, pad: int = 0):
        return batch


    def build(**kwargs):
        return kwargs


    def scale(x, /, factor: float = 2.0):
        return x * factor


    def accuracy(preds, targets, *, top_k: int = 1):
        return 0.0
"""


@pytest.fixture
def mylab(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A package `mylab` on sys.path: `models` (good targets), `broken` (raises), `needs_dep` (missing import)."""
    package = tmp_path / "mylab"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "models.py").write_text(textwrap.dedent(MODELS))
    (package / "broken.py").write_text("RATIO = 1 / 0\n")
    (package / "needs_dep.py").write_text("import mylab_missing_dependency\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    yield package
    for name in [name for name in sys.modules if name == "mylab" or name.startswith("mylab.")]:
        del sys.modules[name]


def good_config() -> dict:
    return {
        "data": {
            "root": "data/mnist",
            "train": {
                "_target_": "mylab.models.build",  # **kwargs: any key goes
                "root": "${data.root}",
                "transform": {"_target_": "mylab.models.Resize", "size": 28},
            },
            "collate_fn": {"_target_": "mylab.models.collate", "_partial_": True, "pad": 0},
        },
        "model": {"_target_": "mylab.models.TinyMLP", "in_features": 784, "hidden": "${oc.env:HIDDEN,64}"},
        "metrics": [{"_target_": "mylab.models.accuracy", "_partial_": True, "top_k": 5}],
        "loss": "model",
        "trainer": {"max_epochs": 1},
        "hydra": {"callbacks": {"bad": {"_target_": "nowhere.Callback"}}},  # Hydra's own: skipped
    }


def message(cfg) -> str:
    with pytest.raises(ConfigError) as caught:
        check_targets(cfg)
    text = str(caught.value)
    assert "\n" not in text
    return text


# ------------------------------------------------------------------------------------------ good configs
def test_a_good_plain_dict_passes(mylab):
    check_targets(good_config())


def test_a_good_dictconfig_passes_without_resolving_interpolations(mylab):
    cfg = OmegaConf.create(good_config())
    cfg.data.train.missing = "${does.not.exist}"  # would raise if resolved
    check_targets(cfg)


def test_torch_targets_pass():
    pytest.importorskip("torch")
    check_targets(
        {
            "optimizer": {"_target_": "torch.optim.AdamW", "_partial_": True, "lr": 1e-3, "weight_decay": 0.01},
            "loss": {"_target_": "torch.nn.CrossEntropyLoss", "label_smoothing": 0.1},
        }
    )


def test_a_classmethod_target_passes_and_its_keywords_are_checked(mylab):
    check_targets({"model": {"_target_": "mylab.models.TinyMLP.from_width", "width": 8}})
    assert message({"model": {"_target_": "mylab.models.TinyMLP.from_width", "widht": 8}}) == (
        "model.widht is not a parameter of mylab.models.TinyMLP.from_width; it takes width, classes "
        "(did you mean 'model.width'?)."
    )


def test_locate_returns_the_object(mylab):
    from mylab.models import TinyMLP

    assert locate("mylab.models.TinyMLP", key="model._target_") is TinyMLP
    assert locate("mylab.models.TinyMLP.from_width", key="model._target_") == TinyMLP.from_width


# ---------------------------------------------------------------------------------------------- imports
def test_a_misspelled_class_names_the_close_match(mylab):
    assert message({"model": {"_target_": "mylab.models.TinyMPL"}}) == (
        "model._target_='mylab.models.TinyMPL' does not import: mylab.models has no 'TinyMPL' "
        "(did you mean 'mylab.models.TinyMLP'?); fix the dotted path."
    )


def test_the_close_match_ignores_case(mylab):
    assert "(did you mean 'mylab.models.TinyMLP'?)" in message({"model": {"_target_": "mylab.models.tinymlp"}})


def test_a_misspelled_submodule_names_the_close_match(mylab):
    assert message({"model": {"_target_": "mylab.modles.TinyMLP"}}) == (
        "model._target_='mylab.modles.TinyMLP' does not import: mylab has no 'modles' "
        "(did you mean 'mylab.models'?); fix the dotted path."
    )


def test_a_name_with_no_close_match_has_no_hint(mylab):
    assert message({"model": {"_target_": "mylab.models.Transformer"}}) == (
        "model._target_='mylab.models.Transformer' does not import: mylab.models has no 'Transformer'; "
        "fix the dotted path."
    )


def test_a_missing_module_says_how_to_make_it_importable(mylab):
    assert message({"model": {"_target_": "mylabb.models.TinyMLP"}}) == (
        "model._target_='mylabb.models.TinyMLP' does not import: there is no module named 'mylabb'; fix the "
        "dotted path, or install the package (or run from the folder that holds it)."
    )


def test_a_package_of_an_extra_that_is_not_installed_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "peft", None)  # as if not installed: importing it fails
    assert message({"model": {"_target_": "runner.models.with_peft", "config": {"_target_": "peft.LoraConfig"}}}) == (
        "model.config._target_='peft.LoraConfig' does not import: peft is not installed; install it with pip "
        'install -e ".[peft]" (or pip install peft).'
    )


def test_a_module_that_raises_on_import_is_reported_with_the_exception(mylab):
    text = message({"model": {"_target_": "mylab.broken.Net"}})
    assert text.startswith(
        "model._target_='mylab.broken.Net' does not import: importing mylab.broken raised "
        "ZeroDivisionError: division by zero (at "
    )
    assert text.endswith(f"{mylab / 'broken.py'}:1); fix that module.")


def test_a_missing_dependency_of_the_module_is_not_mistaken_for_a_wrong_path(mylab):
    assert "importing mylab.needs_dep raised ModuleNotFoundError: No module named 'mylab_missing_dependency'" in (
        message({"model": {"_target_": "mylab.needs_dep.Net"}})
    )


def test_a_target_that_is_not_callable(mylab):
    assert message({"model": {"_target_": "mylab.models.VERSION"}}) == (
        "model._target_='mylab.models.VERSION' is not callable (it is a str); point it at a class or a function."
    )


def test_a_target_that_is_not_a_dotted_path():
    assert message({"model": {"_target_": "mylab..TinyMLP"}}) == (
        "model._target_='mylab..TinyMLP' is not a dotted path; write one like 'package.module.Class'."
    )


# ---------------------------------------------------------------- torch extensions built for another torch
@pytest.fixture
def installed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """``installed(name, version, raises=...)``: a package ``name`` first on sys.path whose import raises
    ``raises``, with its metadata saying ``version`` (None: no metadata); for ``torch``, metadata only (the real
    torch stays the one imported)."""
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in _modules_of("torchvision", "torchaudio", "visionlab"):  # a real one imported already: back afterwards
        monkeypatch.delitem(sys.modules, name)

    def install(name: str, version: str | None, *, raises: str | None = None, source: str | None = None) -> None:
        if version is not None:
            info = tmp_path / f"{name}-{version}.dist-info"
            info.mkdir()
            (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        if raises is not None or source is not None:
            (tmp_path / name).mkdir()
            (tmp_path / name / "__init__.py").write_text(source or f"raise {raises}\n")
        importlib.invalidate_caches()

    yield install
    for name in _modules_of("torchvision", "torchaudio", "visionlab"):
        del sys.modules[name]


def _modules_of(*packages: str) -> list[str]:
    return [name for name in sys.modules if name.split(".")[0] in packages]


CPU_TORCH_INDEX = "--index-url https://download.pytorch.org/whl/cpu"


@pytest.mark.parametrize(
    ("package", "version", "torch", "error", "fix"),
    [
        (  # a CUDA build of torchvision beside the CPU build of torch: what this machine's pip install gives
            "torchvision", "0.28.0", "2.13.0+cpu", 'RuntimeError("operator torchvision::nms does not exist")',
            "torchvision 0.28.0 was built for another torch than the 2.13.0+cpu installed here (RuntimeError: "
            "operator torchvision::nms does not exist); install the torchvision build that matches your torch: "
            f'`pip install "torchvision==0.28.0+cpu" {CPU_TORCH_INDEX}`.',
        ),
        (
            "torchvision", "0.27.0", "2.13.1",
            'ImportError("libc10_cuda.so: cannot open shared object file: No such file or directory")',
            "torchvision 0.27.0 was built for another torch than the 2.13.1 installed here (ImportError: "
            "libc10_cuda.so: cannot open shared object file: No such file or directory); install the torchvision "
            'build that matches your torch: `pip install "torchvision==0.28.1"`.',
        ),
        (
            "torchaudio", None, "2.12.0+cu126", 'OSError("_torchaudio.so: undefined symbol: _ZN3c104cuda")',
            "this torchaudio was built for another torch than the 2.12.0+cu126 installed here (OSError: "
            "_torchaudio.so: undefined symbol: _ZN3c104cuda); install the torchaudio build that "
            'matches your torch: `pip install "torchaudio==2.12.0+cu126" --index-url '
            "https://download.pytorch.org/whl/cu126`.",
        ),
    ],
)  # fmt: skip
def test_a_torch_extension_built_for_another_torch_names_the_install_that_fixes_it(
    installed, package, version, torch, error, fix
):
    installed("torch", torch)
    installed(package, version, raises=error)
    target = f"{package}.datasets.MNIST"
    assert message({"data": {"train": {"dataset": {"_target_": target, "_partial_": True}}}}) == (
        f"data.train.dataset._target_={target!r} does not import: {fix}"
    )


def test_a_users_module_that_imports_a_broken_torchvision_gets_the_same_fix(installed):
    installed("torch", "2.13.0+cpu")
    installed("torchvision", "0.28.0", raises='ImportError("libtorch_cuda.so: cannot open shared object file")')
    installed("visionlab", None, source="import torchvision\n\nclass Net: ...\n")
    assert message({"model": {"_target_": "visionlab.Net"}}) == (
        "model._target_='visionlab.Net' does not import: torchvision 0.28.0 was built for another torch than the "
        "2.13.0+cpu installed here (ImportError: libtorch_cuda.so: cannot open shared object file); install the "
        f'torchvision build that matches your torch: `pip install "torchvision==0.28.0+cpu" {CPU_TORCH_INDEX}`.'
    )


@pytest.mark.parametrize(
    ("package", "error"),
    [
        ("torchvision", "ModuleNotFoundError(\"No module named 'PIL'\", name='PIL')"),  # a missing dependency
        ("visionlab", 'ImportError("_fastops.so: undefined symbol: fast_add")'),  # a user's own extension
    ],
)
def test_other_import_errors_keep_the_generic_sentence(installed, package, error):
    installed("torch", "2.13.0+cpu")
    installed(package, "1.0", raises=error)
    text = message({"model": {"_target_": f"{package}.Net"}})
    assert text.startswith(f"model._target_='{package}.Net' does not import: importing {package} raised ")
    assert text.endswith("__init__.py:1); fix that module.") and "pip install" not in text


# --------------------------------------------------------------------------------------------- keywords
def test_an_unknown_keyword_names_the_close_match(mylab):
    assert message({"model": {"_target_": "mylab.models.TinyMLP", "in_features": 784, "hiden": 64}}) == (
        "model.hiden is not a parameter of mylab.models.TinyMLP; it takes in_features, hidden, classes "
        "(did you mean 'model.hidden'?)."
    )


def test_a_partial_node_gets_the_same_sentence(mylab):
    assert message({"metrics": [{"_target_": "mylab.models.accuracy", "_partial_": True, "topk": 5}]}) == (
        "metrics[0].topk is not a parameter of mylab.models.accuracy; it takes preds, targets, top_k "
        "(did you mean 'metrics[0].top_k'?)."
    )


def test_nested_targets_are_checked_with_their_full_key(mylab):
    cfg = good_config()
    cfg["data"]["train"]["transform"]["sise"] = 32
    assert message(cfg) == (
        "data.train.transform.sise is not a parameter of mylab.models.Resize; it takes size "
        "(did you mean 'data.train.transform.size'?)."
    )
    cfg = good_config()
    cfg["data"]["collate_fn"]["_target_"] = "mylab.models.colate"
    assert message(OmegaConf.create(cfg)).startswith("data.collate_fn._target_='mylab.models.colate' does not import")


def test_a_positional_only_parameter_cannot_be_passed_by_keyword(mylab):
    assert message({"scale": {"_target_": "mylab.models.scale", "x": 3}}) == (
        "scale.x is not a parameter of mylab.models.scale; it takes factor (x is positional-only; pass it in "
        "scale._args_)."
    )


def test_a_torch_target_with_an_unknown_keyword():
    pytest.importorskip("torch")
    text = message({"optimizer": {"_target_": "torch.optim.AdamW", "_partial_": True, "learning_rate": 1e-3}})
    # The tail of AdamW's signature changes between torch releases; its head does not.
    assert text.startswith(
        "optimizer.learning_rate is not a parameter of torch.optim.AdamW; it takes params, lr, betas, eps, "
        "weight_decay, "
    )


# --------------------------------------------------------------------------------------------- trackers
TRACKERS = """
    from runner.engine.tracking.base import GeneralTracker


    class FileTracker(GeneralTracker):
        name = "file"

        def __init__(self, path, fail_at, *, token, level=1):
            super().__init__()

        def log(self, values, step=None, **kwargs):
            pass


    class Scalar(GeneralTracker):
        name = "scalar"

        def __init__(self, scale, /):
            super().__init__()

        def log(self, values, step=None, **kwargs):
            pass
"""


@pytest.fixture
def mytrackers(mylab: Path) -> Path:
    (mylab / "trackers.py").write_text(textwrap.dedent(TRACKERS))
    return mylab


def test_a_tracker_whose_constructor_needs_what_its_node_does_not_set_is_one_sentence(mytrackers):
    assert message({"tracker": {"mine": {"_target_": "mylab.trackers.FileTracker"}}}) == (
        "tracker.mine: mylab.trackers.FileTracker requires path, fail_at and token, which the node does not set "
        "(no default); set them in the node, e.g. +tracker.mine.path=..."
    )
    assert message({"tracker": {"mine": {"_target_": "mylab.trackers.FileTracker", "_args_": ["a.jsonl", 3]}}}) == (
        "tracker.mine: mylab.trackers.FileTracker requires token, which the node does not set (no default); set it in "
        "the node, e.g. +tracker.mine.token=..."
    )
    assert message({"tracker": {"mine": {"_target_": "mylab.trackers.Scalar", "scale": 2}}}).startswith(
        "tracker.mine.scale is not a parameter of mylab.trackers.Scalar; it takes no keyword arguments (scale is "
        "positional-only"
    )
    assert message({"tracker": {"mine": {"_target_": "mylab.trackers.Scalar"}}}) == (
        "tracker.mine: mylab.trackers.Scalar requires scale, which the node does not set (no default); set it in the "
        "node, e.g. +tracker.mine._args_=[...]"
    )


def test_a_tracker_node_that_sets_what_its_constructor_needs_passes(mytrackers):
    by_name = {"_target_": "mylab.trackers.FileTracker", "path": "${oc.env:HOME}/a.jsonl", "fail_at": 3, "token": "t"}
    by_position = {"_target_": "mylab.trackers.FileTracker", "_args_": ["a.jsonl", 3], "token": "t"}
    scalar = {"_target_": "mylab.trackers.Scalar", "_args_": [2]}
    trackers = {"tensorboard": {}, "file": by_name, "by_position": by_position, "scalar": scalar}
    check_targets(OmegaConf.create({"tracker": trackers}))


def test_a_partial_tracker_node_is_refused(mytrackers):
    node = {"_target_": "mylab.trackers.Scalar", "_args_": [2], "_partial_": True}
    assert message({"tracker": {"mine": node}}) == (
        "tracker.mine._partial_=true: the runner builds the tracker itself, whole; remove _partial_ and set its "
        "parameters in the node."
    )


def test_other_targets_may_leave_required_parameters_to_the_recipe(mylab):
    pytest.importorskip("torch")
    check_targets(
        {
            "model": {"_target_": "mylab.models.Resize"},  # size: passed by the recipe (as GPT's vocab_size)
            "optimizer": {"_target_": "torch.optim.AdamW", "_partial_": True, "lr": 1e-3},  # params: the model's
        }
    )


# ------------------------------------------------------------------------------------------------- cost
def test_importing_runner_targets_does_not_import_torch():
    root = Path(__file__).resolve().parents[3]
    code = "import runner.config.targets, sys; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], cwd=root, check=True)
