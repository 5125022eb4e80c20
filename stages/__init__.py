"""Stage entry points, `python -m stages.<name> --run-dir R --iteration K`: thin leaves over hpcrl."""

from __future__ import annotations

import argparse


def cli_args(stage: str, argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=f"python -m stages.{stage}",
                                     description=f"Run the {stage} stage of one iteration and commit it.")
    parser.add_argument("--run-dir", required=True, help="run directory (holds the frozen experiment.toml)")
    parser.add_argument("--iteration", type=int, required=True, help="iteration number, from 0")
    return parser.parse_args(argv)
