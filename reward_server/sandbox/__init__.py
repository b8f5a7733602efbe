"""Sandboxes for untrusted code: one interface (:mod:`.base`), three backends and a last resort.

- :mod:`.gvisor`: warm pool of ``runsc`` sandboxes with a minimal root (default when runsc works);
- :mod:`.bwrap`: bubblewrap namespaces per job, ``--disable-userns`` and a seccomp
  filter (:mod:`.seccomp`) (when gVisor is not usable);
- :mod:`.modal`: ``modal.Sandbox`` pool (in Modal deployments);
- :mod:`.local`: no isolation, only with ``unsafe_local = true``.

All of them run the same in-sandbox supervisor, :mod:`.guest.agent`. Host
cgroups per job (:mod:`.cgroup`) cap a job's memory, processes and CPU as a
whole where the host allows it; :mod:`.blame` decides whether a sandbox that
ended mid-job is an infrastructure failure or the job's doing.
"""

from __future__ import annotations

import logging

from reward_server.sandbox.base import Sandbox
from reward_server.settings import RewardSettings

log = logging.getLogger("tandem.reward")


def choose(settings: RewardSettings) -> tuple[Sandbox | None, str]:
    """The sandbox the settings ask for, or (None, why not). Probes the host; call once at start-up."""
    reasons = []
    if settings.sandbox in ("auto", "gvisor"):
        from reward_server.sandbox.gvisor import GVisorSandbox, cgroups_why_not, runsc_works

        why = runsc_works(settings.runsc, cgroups=cgroups_why_not(settings.cgroups) is None)
        if why is None:
            sandbox = GVisorSandbox(workers=settings.effective_workers, max_jobs=settings.max_jobs_per_sandbox,
                                    runsc=settings.runsc, python=settings.sandbox_python,
                                    max_memory_mb=settings.max_memory_mb, cpus=settings.sandbox_cpus,
                                    cgroups=settings.cgroups)
            return sandbox, "gVisor (runsc)" + ("" if sandbox.limits else ", no cgroups")
        reasons.append(f"gvisor: {why}")
    if settings.sandbox in ("auto", "bwrap"):
        from reward_server.sandbox.bwrap import BwrapSandbox, bwrap_works

        why = bwrap_works(settings.bwrap, settings.sandbox_python)
        if why is None:
            sandbox = BwrapSandbox(workers=settings.effective_workers, bwrap=settings.bwrap,
                                   python=settings.sandbox_python, cpus=settings.sandbox_cpus, cgroups=settings.cgroups)
            return sandbox, "bubblewrap" + (" with a cgroup per job" if sandbox.cgroups else ", no cgroups")
        reasons.append(f"bwrap: {why}")
    if settings.sandbox == "modal":
        from reward_server.sandbox.modal import ModalOptions, ModalSandbox

        options = ModalOptions(app_name=settings.modal_app, pool=settings.modal_pool, cpu=settings.modal_cpu,
                               memory_mb=settings.modal_memory_mb, spawns_per_s=settings.modal_spawns_per_s,
                               max_jobs=settings.max_jobs_per_sandbox)
        return ModalSandbox(options), "Modal Sandboxes"
    if settings.sandbox == "none":
        reasons.append("sandbox = none")
    why = "; ".join(reasons) or "no sandbox"
    if settings.unsafe_local:
        from reward_server.sandbox.local import LocalSandbox

        return LocalSandbox(settings.sandbox_python), f"UNSAFE local execution without isolation ({why})"
    return None, why
