"""``python -m learner --config RUN.toml``: one learner rank (for torchrun / deepspeed launchers).

    torchrun --nproc_per_node 2 -m learner --config RUN.toml

Settings come from ``TANDEM_*`` as for ``tandem serve learner``; rank 0
serves HTTP on ``TANDEM_PORT``.
"""

from __future__ import annotations

import argparse

from services.config import load_run_config
from services.settings import ServiceSettings


def main() -> None:
    ap = argparse.ArgumentParser(description="Run one learner rank.")
    ap.add_argument("--config", required=True)
    args = ap.parse_args()
    from learner import serve

    serve(ServiceSettings(), load_run_config(args.config))


if __name__ == "__main__":
    main()
