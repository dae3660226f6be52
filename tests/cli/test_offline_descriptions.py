"""``python -m cli.offline_descriptions``: the offline-generation baseline's descriptions from the frozen base model
(the toy checkpoint and toy world here), one per drawn training sample, in the synthesis callback's format."""

from __future__ import annotations

import json

import pytest

from callbacks.evolution import read_offline_descriptions
from cli.offline_descriptions import describe, main


def test_descriptions_of_the_drawn_training_samples(tmp_path):
    data = tmp_path / "data"
    args = ["--config", "configs/tiny.yaml", "--trainer.logger", "false"]
    args += ["--data.init_args.data_root", str(data), "--data.init_args.max_train_samples", "4"]
    args += ["--data.init_args.toy.splits", "{train: 8, val: 2, ood: 2}"]
    counts = describe(args, tmp_path / "desc.jsonl")
    lines = [json.loads(x) for x in (tmp_path / "desc.jsonl").read_text().splitlines()]
    assert counts == {"samples": 4, "described": len(lines)} and len(lines) >= 3  # the toy model follows the format
    train_ids = {json.loads(x)["id"] for x in (data / "train.jsonl").read_text().splitlines()}
    assert {x["sample_id"] for x in lines} <= train_ids and len({x["sample_id"] for x in lines}) == len(lines)
    assert all(isinstance(x["description"], str) and x["description"] for x in lines)
    assert set(read_offline_descriptions(str(tmp_path / "desc.jsonl"))) == {x["sample_id"] for x in lines}
    again = tmp_path / "again.jsonl"  # greedy: the same descriptions each time
    describe(args, again)
    assert again.read_text() == (tmp_path / "desc.jsonl").read_text()


def test_a_config_is_required(capsys):
    with pytest.raises(SystemExit):
        main(["--out", "x.jsonl"])
    assert "--config" in capsys.readouterr().err
