"""The CLI, config, wire types and broker import without torch, vllm or deepspeed."""

from __future__ import annotations

import subprocess
import sys

HEAVY = ("torch", "vllm", "deepspeed", "transformers")


def test_light_modules_import_without_heavy_packages():
    code = (
        "import sys, deploy.cli, services.config, services.wire, services.reward_specs, services.settings, services.app, "
        "services.security, services.serving, "
        "services.clients, broker, broker.embedded\n"
        f"heavy = [m for m in {HEAVY!r} if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_cli_help_answers():
    out = subprocess.run(
        [sys.executable, "-m", "deploy.cli", "--help"], capture_output=True, text=True, timeout=60, check=True
    )
    for command in ("serve", "up", "run", "submit", "status"):
        assert command in out.stdout
    assert "demo" not in out.stdout  # its module is gone
