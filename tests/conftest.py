"""Shared fixtures: a tiny Qwen2.5-VL built by the project's factory, and a small REC JSONL with real images."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from PIL import Image, ImageDraw

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

REPO = Path(__file__).resolve().parents[1]

_DIST_ENV = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "LOCAL_WORLD_SIZE")


@pytest.fixture(autouse=True)
def _no_process_group_leaks():
    """A Lightning run in this process (FSDP2 on one device) leaves its process group and ``MASTER_PORT`` behind:
    the next in-process group would fail to initialise, and a multi-process test would inherit a port still bound.
    Each test ends with neither. A colocated vLLM engine (the ``vllm`` tests, in their own venv) owns its group and
    reuses it for its next engine: that one stays."""
    before = {k: os.environ.get(k) for k in _DIST_ENV}
    yield
    import torch.distributed as dist

    vllm_state = sys.modules.get("vllm.distributed.parallel_state")
    vllm_owns = vllm_state is not None and getattr(vllm_state, "_WORLD", None) is not None
    if dist.is_available() and dist.is_initialized() and not vllm_owns:
        dist.destroy_process_group()
    for k, v in before.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


TINY_CORPUS = [
    "Find: the small red circle",
    "Find every: red shape",
    "<think>The query asks for the small red circle. I look for red circles.</think>"
    "<diversity>0.42</diversity><description>a striped blue background with many small green triangles"
    "</description><answer>[12, 40, 96, 120]</answer>",
    "system\nYou are a helpful assistant. user assistant",
] * 20


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A random tiny Qwen2.5-VL (same classes as the 7B) saved with save_pretrained."""
    from lightning_modules.models.tiny_model import build_tiny_qwen2_5_vl

    out = tmp_path_factory.mktemp("tiny-qwen2.5-vl")
    return build_tiny_qwen2_5_vl(
        out,
        TINY_CORPUS,
        vocab_size=320,
        hidden_size=64,
        layers=2,
        heads=4,
        kv_heads=2,
        intermediate_size=128,
        vision_hidden_size=32,
        vision_depth=2,
        vision_heads=2,
        image_size=112,
    )


def write_rec_jsonl(root: Path, n: int = 8, size: int = 112, name: str = "train.jsonl") -> Path:
    """``n`` images of one coloured rectangle each, with the rectangle's box as the REC solution."""
    (root / "images").mkdir(parents=True, exist_ok=True)
    colours = ["red", "green", "blue", "yellow"]
    lines = []
    for i in range(n):
        im = Image.new("RGB", (size, size), (240, 240, 240))
        x1, y1 = 8 + 7 * i % 40, 10 + 5 * i % 30
        box = [x1, y1, x1 + 40, y1 + 30]
        ImageDraw.Draw(im).rectangle([box[0], box[1], box[2] - 1, box[3] - 1], fill=colours[i % 4])
        im.save(root / "images" / f"{i}.png")
        lines.append(
            {
                "id": f"s{i}",
                "image": f"images/{i}.png",
                "solution": box,
                "task": "rec",
                "conversations": [
                    {"from": "human", "value": f"<image>the {colours[i % 4]} rectangle"},
                    {"from": "gpt", "value": str(box)},
                ],
            }
        )
    path = root / name
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


@pytest.fixture()
def rec_dir(tmp_path) -> Path:
    write_rec_jsonl(tmp_path, 8)
    write_rec_jsonl(tmp_path, 4, name="val.jsonl")
    return tmp_path
