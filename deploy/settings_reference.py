"""The settings reference: every process's settings class by name, and docs/settings.md generated from them.

``tandem config`` prints the effective settings of these classes; ``tandem config --markdown`` prints
the reference (:func:`settings_reference`), committed as docs/settings.md (a test compares the two).
``deploy.client.load_settings`` checks the environment against all of them; ``deploy.modal_app`` too.
Light: the classes' modules import pydantic only.
"""

from __future__ import annotations


def settings_classes() -> dict[str, type]:
    """Each process's settings class by name (light modules: pydantic only)."""
    from control_plane.settings import ControlSettings
    from deploy.settings import ClientSettings, StackSettings
    from learner.settings import LearnerSettings
    from reward_server.settings import RewardSettings
    from rollout_server.settings import RolloutSettings

    return {"control": ControlSettings, "rollout": RolloutSettings, "reward": RewardSettings,
            "learner": LearnerSettings, "stack": StackSettings, "client": ClientSettings}


SETTINGS_REFERENCE = "docs/settings.md"
"""Where ``tandem config --markdown`` is committed (a test compares the two)."""


def _markdown_default(name: str, field) -> str:
    """A field's default as the environment would spell it."""
    from pydantic_core import PydanticUndefined

    value = field.default_factory() if field.default is PydanticUndefined else field.default
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, dict | list):
        import json

        return f"`{json.dumps(value)}`"
    text = f"`{value}`"
    if isinstance(value, int) and name.endswith("_bytes"):
        unit = next(((u, s) for u, s in (("GiB", 30), ("MiB", 20), ("KiB", 10)) if value and not value % (1 << s)), None)
        text += f" ({value >> unit[1]} {unit[0]})" if unit else ""
    return text


def settings_reference(names: list[str] | None = None) -> str:
    """The settings reference in Markdown, generated from the settings classes (``tandem config --markdown``).

    One section per settings class, base classes first (what every service reads, then what a rollout
    server and the learner share), each with its own fields: the variable, its type as declared, its
    default and the field's docstring. Nothing here reads the environment, so the page is the same on
    every machine.
    """
    import re

    from pydantic_settings import BaseSettings

    classes = settings_classes()
    readers: dict[type, list[str]] = {}
    for key, cls in classes.items():
        if names is None or key in names:
            for base in reversed(cls.__mro__):
                if issubclass(base, BaseSettings) and base is not BaseSettings:
                    readers.setdefault(base, []).append(key)

    def cell(text: str) -> str:
        return re.sub(r"``([^`]+)``", r"`\1`", " ".join(text.split())).replace("|", "\\|")

    lines = [
        "# Settings reference",
        "",
        "<!-- Generated from the settings classes by `tandem config --markdown`; do not edit by hand. -->",
        f"<!-- Regenerate: .venv/bin/tandem config --markdown > {SETTINGS_REFERENCE} -->",
        "",
        "Each process reads `TANDEM_*` environment variables (and `REDIS_URL`, the one name outside the",
        "prefix); nothing else in the environment changes its behaviour. A `TANDEM_*` variable that no",
        "class below declares stops the CLI at start-up, naming the closest one. `tandem config [NAME]`",
        "prints the effective values as JSON, secrets masked. Lists and mappings are given as JSON.",
    ]
    for cls, keys in readers.items():
        prefix = cls.model_config.get("env_prefix", "")
        summary = (cls.__doc__ or "").strip().split("\n\n")[0]
        module = cls.__module__.replace(".", "/") + ".py"
        lines += ["", f"## {cls.__name__} (`{module}`)", "",
                  f"{cell(summary)} Part of `tandem config {' | '.join(keys)}`.",
                  "", "| variable | type | default | what it does |", "|---|---|---|---|"]
        for field_name, annotation in vars(cls).get("__annotations__", {}).items():
            field = cls.model_fields.get(field_name)
            if field is None:
                continue
            alias = field.validation_alias
            variable = alias if isinstance(alias, str) else f"{prefix}{field_name}".upper()
            declared = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", str(annotation))
            lines.append(f"| `{variable}` | `{cell(declared)}` | {cell(_markdown_default(field_name, field))} "
                         f"| {cell(field.description or '')} |")
    return "\n".join(lines) + "\n"
