"""Checks made before anything is written or launched: of the machine a run is about to use, and of the
constructors its config calls."""

from __future__ import annotations

import ipaddress
import os
import re
import socket
import uuid
from pathlib import Path

from omegaconf import OmegaConf

from runner.config import ConfigError


def check_writable(folder: Path, key: str) -> None:
    """Raise :class:`ConfigError` naming ``key`` unless ``folder`` can be created and written."""
    probe = folder / f".write-test-{uuid.uuid4().hex[:8]}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe.touch(exist_ok=False)  # created exclusively: never through a link of that name
        probe.unlink()
    except OSError as error:
        raise ConfigError(
            f"{key}={folder} cannot be written ({error.strerror or error}); choose a folder this user can write."
        ) from None


def check_resolves(endpoint: str) -> None:
    """Raise :class:`ConfigError` unless the rendezvous host of ``endpoint`` (HOST:PORT) resolves here.

    Every node checks it before it starts; otherwise torch's rendezvous fails on one node after minutes (c10d's
    "cannot be retrieved (gai error)") while the others wait for it up to ``trainer.rdzv_timeout``.
    """
    host = endpoint.rpartition(":")[0].strip("[]") if ":" in endpoint else endpoint
    try:
        socket.getaddrinfo(host, None)
    except (OSError, UnicodeError) as error:
        reason = getattr(error, "strerror", None) or str(error)
        origin = " (the job's first node, from SLURM_JOB_NODELIST)" if "SLURM_JOB_ID" in os.environ else ""
        raise ConfigError(
            f"trainer.rdzv_endpoint={endpoint}: its host {host}{origin} does not resolve on {socket.gethostname()} "
            f"({reason}); make that name resolve on every node (DNS or /etc/hosts), or give "
            "trainer.rdzv_endpoint=ADDRESS:PORT that every node can reach."
        ) from None


def check_rendezvous_port(endpoint: str) -> None:
    """On the node that hosts the rendezvous, raise :class:`ConfigError` if its port is taken.

    Only meaningful on node 0 (the host), before its launcher starts (see :func:`check_port_free`).
    """
    port = endpoint.rpartition(":")[2]
    check_port_free(
        endpoint,
        refusal=ConfigError(
            f"trainer.rdzv_endpoint={endpoint}: port {port} is already in use on this machine (another job, or "
            "a run that has not exited); choose a free port and give every node the same endpoint."
        ),
    )


def check_port_free(endpoint: str, *, refusal: Exception) -> None:
    """Raise ``refusal`` (the caller's wording) if ``endpoint`` (HOST:PORT) is this machine and its port is taken.

    torch's c10d rendezvous would otherwise connect to whatever listens there and wait for it
    forever, or fail with a traceback (EADDRINUSE) when it hosts the store itself. An endpoint
    without a port, or on another machine, is not checked.
    """
    host, _, port = endpoint.rpartition(":")
    if not port.isdigit() or not _is_this_machine(host):
        return
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("", int(port)))
        except OSError:
            raise refusal from None


def _is_this_machine(host: str) -> bool:
    try:
        if ipaddress.ip_address(host).is_loopback:
            return True
    except ValueError:
        pass
    names = {socket.gethostname(), socket.getfqdn(), "localhost"}
    if host in names:
        return True
    try:
        return socket.gethostbyname(host) in {socket.gethostbyname(name) for name in names} | {"127.0.0.1"}
    except OSError:
        return False


def wait_for_rendezvous(endpoint: str, *, timeout: float) -> None:
    """On a node other than node 0, wait up to ``timeout`` seconds for the rendezvous host to answer.

    The node that hosts the rendezvous may start later than the others; a node whose endpoint nobody
    ever serves (a wrong address, node 0 not started) would otherwise fail only after torch's own
    timeouts, with a traceback.

    Raises:
        ConfigError: Nothing accepted a connection at ``endpoint`` within ``timeout`` seconds.
    """
    import logging
    import time

    host, _, port = endpoint.rpartition(":")
    if not port.isdigit():
        raise ConfigError(f"trainer.rdzv_endpoint={endpoint} must be HOST:PORT, the address every node can reach.")
    deadline = time.monotonic() + timeout
    logging.getLogger("runner").info("Waiting up to %.0f s for the rendezvous at %s", timeout, endpoint)
    while True:
        try:
            with socket.create_connection((host, int(port)), timeout=min(5.0, timeout)):
                return
        except OSError:
            if time.monotonic() >= deadline:
                break
            time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))
    raise ConfigError(
        f"trainer.rdzv_endpoint={endpoint}: nothing answered there within {timeout:g} s (trainer.rdzv_timeout); "
        "start node 0 (trainer.node_rank=0) with the same endpoint, or fix the address."
    )


def check_construction(cfg) -> None:
    """Build the run's model, optimizer, scheduler, loss and metrics once, in the launching process, so a
    constructor that rejects a value (``model.channels=0``, ``optimizer.betas=[1.5,0.9]``) stops the run in
    one sentence before any process starts or anything is written.

    The model is built on the meta device (no memory, no initialisation): checking a large model costs
    nothing. Recipes other than the supervised one build their model with arguments of their own (the
    language model's vocabulary size comes from its data), so only their optimizer and scheduler are
    checked here, on a stand-in parameter; so are they for a model loaded from files or the Hub
    (``from_pretrained``), which is not loaded twice. What only the real build can tell (a constructor
    that reads files, or that the meta device cannot run) is left to the workers, which report it the
    same way.

    Raises:
        ConfigError: One sentence naming the node, its values and the constructor's message.
    """
    import torch

    from runner.config import RECIPES
    from runner.metrics import build_metrics
    from runner.models.run_weights import weights_from_checkpoint
    from runner.training.components import build, build_loss
    from runner.training.loop import build_optimizer, build_scheduler

    try:
        with torch.device("meta"), weights_from_checkpoint("check"):  # from_run: its source exists, nothing read
            parameters = [torch.nn.Parameter(torch.empty(1))]
            if RECIPES.get(cfg.recipe) == RECIPES["supervised"] and not _reads_weights(cfg.model):
                model = build(cfg.model, key="model")
                _check_tp_plan(cfg, model)
                parameters = list(model.parameters()) or parameters
            elif RECIPES.get(cfg.recipe) == RECIPES["language_model"] and not _reads_weights(cfg.model):
                # Its vocabulary comes from the data; the plan's layers do not depend on its size.
                _check_tp_plan(cfg, build(cfg.model, key="model", vocab_size=_STAND_IN_VOCABULARY))
            optimizer = build_optimizer(cfg.optimizer, parameters)
            build_scheduler(cfg.scheduler, optimizer, cfg.trainer.max_steps or 1)
            build_loss(cfg.loss)
        build_metrics(cfg.metrics, device="cpu")
    except ConfigError as error:
        if _META.search(str(_original(error))):  # the meta device, not the value, failed: the workers will tell
            return
        raise
    except Exception:  # anything else shows in the real build, with its traceback if it is a bug
        return


_STAND_IN_VOCABULARY = 256


def _check_tp_plan(cfg, model) -> None:
    """Under tensor parallelism, the plan (``parallel.tp_plan``, or the model's own) fits the model: every pattern
    names a layer that splits, into whole heads and features for ``parallel.tp`` processes."""
    tp = OmegaConf.select(cfg, "parallel.tp", default=1)
    if OmegaConf.select(cfg, "parallel.strategy") != "fsdp" or tp == 1:
        return
    from runner.engine.parallel.tensor_parallel import check_tp_plan, default_tp_plan

    plan = OmegaConf.select(cfg, "parallel.tp_plan")
    plan = OmegaConf.to_container(plan) if plan is not None else default_tp_plan(model)
    if not plan:
        raise ConfigError(
            f"parallel.tp={tp} needs a tensor-parallel plan, and {type(model).__name__} has no tp_plan attribute; set "
            "parallel.tp_plan (module-name patterns to colwise, rowwise or sequence)."
        )
    try:
        check_tp_plan(model, plan, tp)
    except ValueError as error:
        raise ConfigError(str(error)) from None


def _reads_weights(node) -> bool:
    """Whether ``node``, or a node inside it, loads a model from files or the Hub (``from_pretrained``,
    ``torch.hub.load``): checking it would download and read the weights once more before the workers do.
    ``runner.models.from_run`` reads nothing here (see :func:`runner.models.run_weights.weights_from_checkpoint`)."""
    if OmegaConf.is_list(node):
        return any(_reads_weights(item) for item in node)
    if not OmegaConf.is_dict(node):
        return False
    target = str(node.get("_target_", ""))
    name = target.rsplit(".", 1)[-1]
    if target != "runner.models.from_run" and (name.startswith("from_") or name == "load"):
        return True
    return any(_reads_weights(node._get_node(key)) for key in node if key != "_target_")


_META = re.compile(r"\bmeta\b", re.IGNORECASE)  # in torch's messages about meta tensors and the Meta backend


def _original(error: BaseException) -> BaseException:
    """The exception a ConfigError reports: the deepest cause or context under it."""
    while (inner := error.__cause__ or error.__context__) is not None:
        error = inner
    return error
