"""Descriptions for the "GRPO + Offline Generation" baseline on real data, written once before training.

    python -m cli.offline_descriptions --config configs/rec_3b.yaml --out descriptions.jsonl [--flags of the config]

The paper's came from GPT-4o before training; ours come from the frozen base model: the config's policy answers each
training sample once, greedily, under the config's prompt (Syn-GRPO's asks for a ``<description>`` of a new image),
through ``GRPOModule.predict_step`` (``train.py predict``'s code path) on the config's training set: the same files,
the same seeded draw (``max_train_samples``), so the sample ids are those training will use. Each parsed description
becomes a line ``{"sample_id", "description"}`` (``configs/baselines/offline_generation.yaml``'s
``offline_descriptions``); a sample whose answer has none gets no line (the data server leaves it as it is). One device,
the config's accelerator and precision; nothing is trained and nothing is written to a run folder.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import lightning as L
from torch.utils.data import DataLoader

from cli.errors import fail
from cli.main import cli_main
from core.records import DataError
from core.rewards import parse_completion
from datamodules.rec import collate_samples


def describe(config_args: list[str], out: str | Path) -> dict[str, int]:
    """Answer the config's training samples greedily and write their descriptions to ``out``; returns counts."""
    cli = cli_main(config_args, run=False)
    model, dm = cli.model, cli.datamodule
    dm.prepare_data()
    dm.setup("fit")
    train = dm._train_set()
    if not hasattr(train, "records"):
        raise DataError("offline descriptions need a JSONL training set (--data.toy.render_train must be false)")
    t = cli.config.trainer
    trainer = L.Trainer(
        accelerator=t.accelerator,
        devices=1,
        precision=t.precision,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=t.default_root_dir,
    )
    loader = DataLoader(train, batch_size=dm.eval_batch_size, shuffle=False, collate_fn=collate_samples)
    rows = [r for batch in trainer.predict(model, dataloaders=loader) for r in batch]
    lines = []
    for r in rows:
        desc = parse_completion(r["completion"]).description
        if desc:
            lines.append(json.dumps({"sample_id": r["sample_id"], "description": desc}) + "\n")
    if not lines:
        raise DataError(
            f"none of the {len(rows)} greedy answers has a <description>: use a config whose prompt asks for one "
            "(--model.sampling.prompt_template syn_grpo, the paper configs') and a model that follows it"
        )
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(out.suffix + ".tmp")
    tmp.write_text("".join(lines))
    tmp.replace(out)
    return {"samples": len(rows), "described": len(lines)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m cli.offline_descriptions",
        description="Write the offline-generation baseline's descriptions from the frozen base model (greedy).",
        epilog="Other flags (--config ..., --model..., --data...) are the config's, as for train.py.",
    )
    ap.add_argument("--out", required=True, help="the JSONL to write (offline_descriptions of the baseline)")
    known, rest = ap.parse_known_args(argv)
    if "--config" not in rest and not any(a.startswith("--config=") for a in rest):
        fail("cli.offline_descriptions: give --config <the base config, e.g. configs/rec_3b.yaml>", 2)
    counts = describe(rest, known.out)
    print(f"{known.out}: {counts['described']} descriptions for {counts['samples']} training samples", file=sys.stderr)


if __name__ == "__main__":
    main()
