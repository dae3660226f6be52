"""EvolvedGRPO's co-evolution rounds in one resumable command: ``python -m cli.coevolve``.

    python -m cli.coevolve --config configs/coevolve/tiny.yaml --out runs/coevolve          # CPU, toy math world
    python -m cli.coevolve --config configs/coevolve/7b.yaml --out runs/coevolve_7b         # the paper's 5 rounds
    python -m cli.coevolve --config configs/coevolve/tiny.yaml --out runs/coevolve --rounds 3   # extend to 3 rounds

D_1 -> A_1 -> Q_1 -> D_2 -> ... : A_k and Q_k train through ``train.py fit`` with the config's A and Q configs, are
exported as HF folders, A_k is evaluated (``train.py test``), and D_{k+1} is D_k edited by Q_k and labelled by A_k,
with per-row lineage (`runner.coevolution_rounds`, docs/evolved_coevolution.md, "The rounds"). The same
command started again after a kill continues where it stopped: finished stages are skipped, an unfinished fit resumes
from its last checkpoint, an unfinished dataset from its last written chunk. Outputs: ``<out>/state.json``,
``<out>/round_<k>/{dataset.jsonl, answer/, question/, answer_eval/, metrics.json}``, ``<out>/summary.json``.

A mistake in the config or run folder prints one line and exits 2, a data file's defect exits 3.
"""

from __future__ import annotations

import argparse
import json
import sys

from cli.errors import fail
from cli.main import cli_main
from core.records import DataError
from runner.coevolution_config import RoundsConfig, RoundsError
from runner.coevolution_rounds import Rounds


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m cli.coevolve",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n\n".join(__doc__.split("\n\n")[1:]),
        allow_abbrev=False,
    )
    parser.add_argument("--config", required=True, help="the rounds' YAML (configs/coevolve/*.yaml)")
    parser.add_argument("--out", required=True, help="the run folder (created; the same folder resumes)")
    parser.add_argument("--rounds", type=int, default=None, help="override the config's rounds (more extends a run)")
    parser.add_argument(
        "--mode", choices=("coevolve", "plain"), default=None, help="override the config's mode (plain: the baseline)"
    )
    parser.add_argument("--seed", type=int, default=None, help="override the config's seed (a study's seeds)")
    parser.add_argument(
        "--launcher",
        choices=("subprocess", "inprocess"),
        default=None,
        help="override the config's launcher: train.py as a process per stage, or in this process",
    )
    return parser


def launch_inprocess(args: list[str]) -> None:
    """``train.py <args>`` in this process (``launcher: inprocess``)."""
    argv, sys.argv = sys.argv, sys.argv[:1]  # LightningCLI also reads sys.argv when given args (and warns)
    try:
        cli_main(args)
    finally:
        sys.argv = argv


def main(argv: list[str] | None = None) -> dict:
    args = _parser().parse_args(argv)
    given = (("rounds", args.rounds), ("launcher", args.launcher), ("mode", args.mode), ("seed", args.seed))
    overrides = {k: v for k, v in given if v is not None}
    try:
        cfg = RoundsConfig.from_yaml(args.config, overrides)
        summary = Rounds(cfg, args.out, launch=launch_inprocess).run()
    except FileNotFoundError as e:
        fail(f"--config {args.config}: {e}")
    except RoundsError as e:
        fail(str(e))
    except DataError as e:
        fail(str(e), 3)
    print(json.dumps(summary["per_round"], indent=2))
    return summary


if __name__ == "__main__":
    main(sys.argv[1:])
