"""deploy.launch: the service command lines the local stack and a Modal container share, as the CLI and torchrun parse them."""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from deploy import launch


def _serve_params(argv: list[str]) -> dict:
    from deploy.cli import app as cli

    assert argv[:2] == ["serve", argv[1]]
    return typer.main.get_command(cli).commands["serve"].make_context("serve", argv[1:]).params


def test_serve_with_a_port_and_no_config_as_the_stack_starts_a_service():
    argv = launch.serve_argv("reward", port=4321)
    assert argv[:3] == [sys.executable, "-m", "deploy.cli"]
    params = _serve_params(argv[3:])
    assert params["name"].value == "reward" and params["port"] == 4321 and params["config"] is None


def test_a_local_multi_rank_learner_gets_its_own_rendezvous_port():
    from torch.distributed.run import get_args_parser

    argv = launch.torchrun_argv(nproc_per_node=2, master_port=29611, port=4322, config=Path("/tmp/run.toml"))
    args = get_args_parser().parse_args(argv[3:])
    assert (args.nnodes, args.nproc_per_node, args.node_rank, args.master_port) == ("1", "2", 0, 29611)
    assert args.module and args.training_script == "deploy.cli"
    params = _serve_params(args.training_script_args)
    assert params["name"].value == "learner" and params["port"] == 4322
    assert params["config"] == Path("/tmp/run.toml")
