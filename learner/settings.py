"""Learner settings: ``TANDEM_LEARNER_*`` on top of ``services.settings``."""

from __future__ import annotations

import ipaddress
import os
import socket

from pydantic import Field, model_validator

from services.settings import WorkerSettings, settings_config


class LearnerSettings(WorkerSettings):
    """`tandem serve learner` (every rank of a multi-rank job): ``TANDEM_LEARNER_*``."""

    model_config = settings_config("TANDEM_LEARNER_")

    poll_s: float = Field(default=0.5, gt=0)
    """Without TANDEM_RUN_ID: how often the learner looks for the control plane's active run."""
    one_run: str | None = None
    """Train this one run of the run registry, with the config it was submitted with, and exit when it
    ends (TANDEM_LEARNER_ONE_RUN; the Modal learner, which the control plane spawns per run). Unset,
    without TANDEM_RUN_ID: follow every run the control plane activates (`tandem up`, docker-compose)."""
    holder: str | None = None
    """This learner's id in its run's lease (TANDEM_LEARNER_HOLDER; every rank of one job must agree).
    Unset: ``host:pid`` of the process (of torchrun's agent, under torchrun). On Modal: the spawned
    call's id and a part new in each attempt Modal makes, so an attempt Modal gave up on that still
    runs cannot renew the lease of the one that replaced it."""
    lease_s: float = Field(default=30.0, gt=0)
    """Length of the run's learner lease, renewed every third of it (TANDEM_LEARNER_LEASE_S). A second
    learner of a run waits 1.5 times this for the lease and then gives up, naming its holder; a learner
    that cannot renew it for this long ends itself."""

    borrow_threads: int = Field(default=0, ge=0)
    """Torch threads the learner adds to its own while no group of its run is in flight (the rollout servers
    wait for room), for a one-rank CPU learner that shares a machine's cores with a rollout server
    (``learner.borrowed_cores``; TANDEM_LEARNER_BORROW_THREADS). ``tandem run`` and ``tandem up`` set it to
    the rollout server's share of the cores (``deploy.stack.cpu_split``). 0: never."""

    broadcast_host: str = "127.0.0.1"
    """The address of this learner that rollout servers reach to join a weight broadcast
    (TANDEM_LEARNER_BROADCAST_HOST; the run config's ``publish.transport = "broadcast"``): rank 0 hosts
    each version's group store and its gloo sockets on free ports of this address alone. A member
    joins only with TANDEM_TOKEN (the group's store is signed with a key derived from it), so an
    address other than loopback needs a token. The tensors themselves travel on the interface gloo
    picks from the host name (``GLOO_SOCKET_IFNAME`` overrides it, on both sides). Empty: no address
    the rollout servers can reach (a Modal deploy without ``[modal].i6pn``): the versions of a
    broadcast run are written as files at once, with no ``publish.broadcast_timeout_s`` wait."""

    @model_validator(mode="after")
    def _broadcast_needs_a_token(self) -> LearnerSettings:
        if not self.broadcast_host:
            return self
        try:
            loopback = ipaddress.ip_address(self.broadcast_host).is_loopback
        except ValueError:
            loopback = self.broadcast_host == "localhost"
        if not loopback and not (self.token and self.token.get_secret_value()):
            raise ValueError(f"TANDEM_LEARNER_BROADCAST_HOST={self.broadcast_host} needs TANDEM_TOKEN: without it "
                             "anyone who reaches that address could join the weight broadcast")
        return self

    @property
    def holder_id(self) -> str:
        """:attr:`holder`, or its default (every rank of a torchrun job shares the agent's pid)."""
        if self.holder:
            return self.holder
        under_torchrun = "TORCHELASTIC_RUN_ID" in os.environ
        return f"{socket.gethostname()}:{os.getppid() if under_torchrun else os.getpid()}"
