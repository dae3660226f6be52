"""SFTModule builds the toy model from scratch, fine-tunes it on the 4-part format and exports an HF directory."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import lightning as L

from callbacks.heldout import HeldOutSummary
from lightning_modules.models.loading import load_policy
from train import cli_main

REPO = Path(__file__).resolve().parents[2]


class _Losses(L.Callback):
    def __init__(self):
        self.losses = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))


def test_sft_builds_trains_and_exports(tmp_path):
    spec = {
        "vocab_size": 400,
        "hidden_size": 64,
        "layers": 2,
        "heads": 4,
        "kv_heads": 2,
        "intermediate_size": 128,
        "vision_hidden_size": 32,
        "vision_depth": 1,
        "vision_heads": 2,
        "image_size": 112,
        "mrope_section": None,
    }
    cli = cli_main(
        [
            "--config",
            str(REPO / "configs/toy_sft.yaml"),
            "--model.init_args.policy.model_name_or_path",
            str(tmp_path / "init"),
            "--model.init_args.build_tiny",
            json.dumps(spec),
            "--model.init_args.export_dir",
            str(tmp_path / "export"),
            "--model.init_args.eval_max_new_tokens",
            "8",
            "--data.init_args.data_root",
            str(tmp_path / "data"),
            "--data.init_args.toy",
            json.dumps({"splits": {"train": 4, "val": 2}, "seed": 0, "size": 112}),
            "--data.init_args.val_files",
            json.dumps({"toy_val": "val.jsonl"}),
            "--data.init_args.batch_size",
            "4",
            "--data.init_args.shuffle",
            "false",
            "--trainer.max_epochs",
            "4",
            "--trainer.val_check_interval",
            "1.0",
            "--trainer.logger",
            "false",
            "--trainer.enable_progress_bar",
            "false",
            "--trainer.default_root_dir",
            str(tmp_path / "run"),
        ],
        run=False,
    )
    losses = _Losses()
    cli.trainer.callbacks.append(losses)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    assert not [w for w in caught if "eval mode" in str(w.message)], "the policy must train in train mode"
    assert len(losses.losses) == 4 and losses.losses[-1] < losses.losses[0]
    assert "val/toy_val/acc50" in cli.trainer.callback_metrics
    # the held-out summary reads an SFT run as it reads a GRPO one (SFT continued is RL's control): greedy answers
    # under the first training template, the validation's reading
    hits = HeldOutSummary(scenes=2, splits=("val",), batch_size=2).measure(cli.trainer, cli.model)
    assert len(hits["val"]) == 2 and set(hits["val"]) <= {0, 1}
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
    assert m.examples.target_for(s, (200, 100)) == "<answer>[20, 20, 40, 40]</answer>"


def test_encode_labels_are_exactly_the_targets(tiny_model_dir):
    """One processor call: prompt tokens as the processor makes them, then each target, left-padded, labels on the
    target only; the image features line up with the image tokens (the forward runs)."""
    from datamodules.toy import ToySceneDataset
    from lightning_modules.models.prompts import build_prompt_text
    from lightning_modules.models.qwen_vl import model_input_size
    from lightning_modules.sft import SFTModule

    m = SFTModule(policy={"model_name_or_path": str(tiny_model_dir), "dtype": "fp32"}, target="toy")
    m.policy, m.processor = load_policy(str(tiny_model_dir), dtype="fp32")
    batch = [ToySceneDataset("train", 3, seed=0)[i] for i in range(3)]
    enc = m.encode(batch)
    tok = m.processor.tokenizer
    for i, s in enumerate(batch):
        row = enc["input_ids"][i][enc["attention_mask"][i].bool()]
        prompt = m.processor(
            text=[build_prompt_text(m.processor, s.query, template="toy")], images=[s.image], return_tensors="pt"
        )["input_ids"][0]
        assert row[: len(prompt)].tolist() == prompt.tolist()
        wh = model_input_size(enc["image_grid_thw"], 14)[i]
        target = tok.decode(enc["labels"][i][enc["labels"][i] != -100])
        assert target == m.examples.target_for(s, wh) + "<|im_end|>"
        assert (enc["labels"][i][enc["labels"][i] != -100] == row[len(prompt) :]).all()
    assert (enc["mm_token_type_ids"] == (enc["input_ids"] == m.policy.config.image_token_id)).all()
    out = m.policy(**{k: v for k, v in enc.items() if k != "labels"}, use_cache=False)
    assert out.logits.shape[:2] == enc["input_ids"].shape


def test_tokenizer_splits_digits_as_qwen2(tmp_path):
    from lightning_modules.models.tiny_model import train_bpe_tokenizer

    tok = train_bpe_tokenizer(["<answer>[112, 45, 160, 99]</answer> the small red circle"] * 20, vocab_size=300)
    ids = tok("[112, 45]")["input_ids"]
    assert [tok.decode([i]) for i in ids if tok.decode([i]).strip().isdigit()] == ["1", "1", "2", "4", "5"]
    tok.save_pretrained(tmp_path)
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(tmp_path)("[112, 45]")["input_ids"] == ids
    # split_digits=False (the toy checkpoint): a number of the corpus is one token
    whole = train_bpe_tokenizer(
        ["<answer>[112, 45, 160, 99]</answer> the small red circle"] * 20, vocab_size=300, split_digits=False
    )
    assert "112" in [whole.decode([i]).strip() for i in whole("[112, 45]")["input_ids"]]


def test_the_evolved_stage_batches_give_a_finite_loss_and_gradients():
    """configs/toy_sft_stage_evolved.yaml's examples (evolved scenes, the `toy_steps` target, both prompt templates)
    through the embedded checkpoint, under bf16 autocast as on the GPU: every target has labels, the loss and every
    gradient are finite (the first GPU build of the stage went NaN: docs/toy_model.md)."""
    import math

    import torch

    from datamodules.toy import ToySceneDataset
    from lightning_modules.sft import SFTModule

    ckpt = str(REPO / "checkpoints/toy-qwen2.5-vl")
    m = SFTModule(
        policy={"model_name_or_path": ckpt, "dtype": "fp32"}, target="toy_steps", prompt_template=["toy", "vlm_r1"]
    )
    m.policy, m.processor = load_policy(ckpt, dtype="fp32")
    ds = ToySceneDataset("train", 64, seed=0, mix={"varied": 0.25}, evolve=0.75)
    batch = [ds[i] for i in range(16)]
    assert any("<step>" in m.examples.target_for(s, (224, 224)) for s in batch)
    enc = m.encode(batch)
    labels = enc.pop("labels")
    assert ((labels != -100).sum(1) > 0).all()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = m.policy(**enc, use_cache=False).logits[:, :-1].float()
    loss = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100
    )
    loss.backward()
    assert math.isfinite(float(loss))
    assert all(torch.isfinite(p.grad).all() for p in m.policy.parameters() if p.grad is not None)
