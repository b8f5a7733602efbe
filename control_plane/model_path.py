"""Where a submitted run's model is, as the deployment sees it.

``tandem submit`` reads the run config on the user's machine, where
``model.path`` resolves to that machine's folder (``/home/me/tandem/runs/models/Qwen3-8B-Base``);
the rollout servers and the learner read the same model from the deployment's run directory
(``/runs/models/Qwen3-8B-Base`` on Modal and under docker-compose, where the volume holds what
``modal volume put`` uploaded from the user's ``runs/``). A rollout server serves a run only if the
run's ``model.path`` is the one it loaded, and the learner loads that path: so the control plane
stores the path as the deployment sees it, before anything is enqueued.

:func:`deployed_model` decides, in this order:

1. ``model.path`` lies in an allowed folder (the run directory, or one of
   ``TANDEM_CONTROL_MODEL_DIRS``; symlinks and ``..`` resolved first) and exists here: kept
   (the local stack: client and services share a disk, and ``tandem up`` allows every folder);
2. the client named its run directory (``client_run_dir``, ``tandem submit`` sends its
   ``TANDEM_RUN_DIR``) and ``model.path`` lies under it: the same relative path under this
   control plane's run directory, if it exists there, still inside it once resolved (reloading
   the Modal volume first when it is not there yet: a model uploaded after the control plane's
   container started);
3. otherwise :class:`ModelNotVisible`, which the control plane answers 422 naming
   ``model.path``, with the allowed paths it looked at.

A path outside the allowed folders is never looked at: whoever may submit a run (not only the
operator) would otherwise learn which paths exist in the control plane's container, and have the
learner and the rollout servers load a folder of their choosing.

The rollout servers and the learner mount the same run directory as the control plane (Modal,
docker-compose) or share its disk (``tandem up``), so a path this process sees is theirs too.
"""

from __future__ import annotations

import logging
from pathlib import Path, PurePath

from services.config import RunConfig

log = logging.getLogger("tandem.control")


class ModelNotVisible(ValueError):
    """The run's ``model.path`` is not on this control plane's machine, nor under its run directory."""


def deployed_model(config: RunConfig, client_run_dir: str | None, run_dir: Path,
                   volume: str | None = None, model_dirs: list[Path] = ()) -> RunConfig:
    """``config`` with ``model.path`` as the deployment sees it (module docstring); blocking (disk,
    a volume reload): call it in a thread. ``model_dirs``: folders besides ``run_dir`` a model may be in."""
    root = Path(run_dir).resolve()
    allowed = [root, *(Path(d).resolve() for d in model_dirs)]
    path = Path(config.model.path)
    looked = []
    if _inside(path, allowed):
        if path.exists():
            return config
        looked.append(str(path))
    rel = _under(path, client_run_dir)
    if rel is not None:
        here = (root / rel).resolve()
        if here.is_relative_to(root):
            looked.append(str(here))
            if not here.exists() and volume:
                _reload(volume)
            if here.exists():
                return config.model_copy(update={"model": config.model.model_copy(update={"path": here})})
    hint = ("" if rel is not None else
            f" (it is not under the submitting client's run directory {client_run_dir}, which mirrors this one)"
            if client_run_dir else " (the client named no run directory to map it from)")
    where = (f"no model folder at {' nor at '.join(looked)} on the control plane" if looked else
             f"{path} is outside the control plane's run directory {root} and TANDEM_CONTROL_MODEL_DIRS")
    raise ModelNotVisible(
        f"model.path: {where}{hint}; put the model in the deployment's run directory {root} (on Modal: "
        "`modal volume put <volume> <local folder> models/<name>`, docs/modal.md), or give a path the "
        "services can read under it or under TANDEM_CONTROL_MODEL_DIRS"
    )


def _inside(path: Path, folders: list[Path]) -> bool:
    """``path``, resolved (symlinks, ``..``), lies in one of ``folders`` (resolved already)."""
    resolved = path.resolve()
    return any(resolved.is_relative_to(f) for f in folders)


def _under(path: Path, client_run_dir: str | None) -> PurePath | None:
    """``path`` relative to the client's run directory, or None when it is not under it."""
    if not client_run_dir:
        return None
    try:
        rel = PurePath(path).relative_to(PurePath(client_run_dir))
    except ValueError:
        return None
    return None if ".." in rel.parts else rel


def _reload(volume: str) -> None:
    from services.weightstore import reload_volume

    try:
        reload_volume(volume)
    except Exception as e:  # noqa: BLE001  Modal refuses while files are open; the 422 says what was missing
        log.warning("could not reload volume %s to look for a model uploaded since start-up: %r", volume, e)
