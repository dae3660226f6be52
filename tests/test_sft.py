"""SFTModule builds the toy model from scratch, fine-tunes it on the 4-part format and exports an HF directory."""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L

from lightning_modules.policy import load_policy
from train import cli_main

REPO = Path(__file__).resolve().parents[1]


class _Losses(L.Callback):
    def __init__(self):
        self.losses = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))


def test_sft_builds_trains_and_exports(tmp_path):
    spec = {"vocab_size": 400, "hidden_size": 64, "layers": 2, "heads": 4, "kv_heads": 2, "intermediate_size": 128,
            "vision_hidden_size": 32, "vision_depth": 1, "vision_heads": 2, "image_size": 112}
    cli = cli_main([
        "--config", str(REPO / "configs/toy_sft.yaml"),
        "--model.init_args.model_name_or_path", str(tmp_path / "init"),
        "--model.init_args.build_tiny", json.dumps(spec),
        "--model.init_args.export_dir", str(tmp_path / "export"),
        "--model.init_args.eval_max_new_tokens", "8",
        "--data.init_args.data_root", str(tmp_path / "data"),
        "--data.init_args.toy", json.dumps({"splits": {"train": 4, "val": 2}, "seed": 0, "size": 112}),
        "--data.init_args.val_files", json.dumps({"toy_val": "val.jsonl"}),
        "--data.init_args.batch_size", "4", "--data.init_args.shuffle", "false",
        "--trainer.max_epochs", "4", "--trainer.logger", "false", "--trainer.enable_progress_bar", "false",
        "--trainer.default_root_dir", str(tmp_path / "run"),
    ], run=False)
    losses = _Losses()
    cli.trainer.callbacks.append(losses)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    assert len(losses.losses) == 4 and losses.losses[-1] < losses.losses[0]
    assert "val/toy_val/acc50" in cli.trainer.callback_metrics
    model, processor = load_policy(str(tmp_path / "export"), dtype="fp32")
    assert type(model).__name__ == "Qwen2_5_VLForConditionalGeneration"
    # the byte-level BPE trained on the toy corpus round-trips text, and "description" merged below its 11 bytes
    tok = processor.tokenizer
    text = "<description>a striped blue background</description>"
    assert tok.decode(tok(text)["input_ids"]) == text
    assert len(tok.tokenize("description")) < len("description")


def test_vlm_r1_targets_keep_only_think_and_answer():
    from datamodules.rec import Sample
    from lightning_modules.sft import SFTModule

    m = SFTModule(prompt_template=["vlm_r1"], target="answer")
    from PIL import Image

    s = Sample("x", Image.new("RGB", (100, 50)), "q", [[10, 10, 20, 20]])
    assert m.target_for(s, (200, 100)) == "<answer>[20, 20, 40, 40]</answer>"
