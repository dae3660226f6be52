"""SAM 2 segmenters with random weights, saved as the folders the ``sam2`` foreground masker loads.

No SAM 2 weights exist on this machine or on the GPU machine, and none may be downloaded at run time. The data
server's ``sam2`` masker (``synth.foreground.Sam2Masker``) reads a transformers SAM 2 folder (config, weights,
processor) with ``from_pretrained(local_files_only=True)``. This module writes such a folder from a config:

- ``size="tiny"``: ~120k parameters at a 128 x 128 input, for the CPU tests (the paper configs' fit steps run their
  server with it; milliseconds a forward);
- ``size="large"``: the published ``sam2.1-hiera-large`` architecture (224M parameters, 1024 x 1024 input), for the
  GPU throughput bench (``bench/e2e_gpu.py --server``). Its compute per image equals the real checkpoint's; its masks
  are noise, so a quality figure needs the real weights (``bench/segmenter_quality.py``).

    python -m synth.random_sam2 --size large --out /tmp/sam2-large
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

__all__ = ["SIZES", "sam2_parts", "save_random_sam2"]

SIZES = ("tiny", "large")

# sam2.1_hiera_l.yaml of facebookresearch/sam2: the Hiera-L trunk (embed dim 144, 2 heads doubling per stage,
# stages [2, 6, 36, 4], global attention at blocks 23 / 33 / 43, windows [8, 4, 16, 8], a 7 x 7 background of the
# windowed positional embedding) and its FPN neck (256 channels) at a 1024 x 1024 input
_LARGE_BACKBONE = dict(
    hidden_size=144,
    num_attention_heads=2,
    blocks_per_stage=[2, 6, 36, 4],
    embed_dim_per_stage=[144, 288, 576, 1152],
    num_attention_heads_per_stage=[2, 4, 8, 16],
    window_size_per_stage=[8, 4, 16, 8],
    global_attention_blocks=[23, 33, 43],
    window_positional_embedding_background_size=[7, 7],
    image_size=[1024, 1024],
)


def sam2_parts(size: str = "tiny") -> tuple[dict[str, Any], int]:
    """The ``Sam2Config`` keyword arguments of ``size`` and its input side in pixels."""
    if size == "tiny":
        side = 128
        backbone = dict(
            model_type="sam2_hiera_det_model",
            hidden_size=8,
            image_size=[side, side],
            blocks_per_stage=[1, 1, 2, 1],
            embed_dim_per_stage=[8, 16, 32, 64],
            num_attention_heads_per_stage=[1, 1, 1, 1],
            window_size_per_stage=[4, 4, 4, 4],
            global_attention_blocks=[3],  # not a stage's first block (those pool their queries with the window)
            window_positional_embedding_background_size=[2, 2],
        )
        parts = dict(
            vision_config=dict(
                backbone_config=backbone,
                backbone_channel_list=[64, 32, 16, 8],
                backbone_feature_sizes=[[side // 4] * 2, [side // 8] * 2, [side // 16] * 2],
                fpn_hidden_size=32,
            ),
            prompt_encoder_config=dict(hidden_size=32, image_size=side, patch_size=16),
            mask_decoder_config=dict(hidden_size=32, mlp_dim=64, num_attention_heads=2, iou_head_hidden_dim=32),
        )
        return parts, side
    if size == "large":
        side = 1024
        parts = dict(
            vision_config=dict(
                backbone_config=dict(model_type="sam2_hiera_det_model", **_LARGE_BACKBONE),
                backbone_channel_list=[1152, 576, 288, 144],
                backbone_feature_sizes=[[256, 256], [128, 128], [64, 64]],
                fpn_hidden_size=256,
            ),
        )
        return parts, side
    raise ValueError(f"SAM 2 size must be one of {SIZES}, got {size!r}")


def save_random_sam2(out: str | Path, size: str = "tiny", seed: int = 0) -> Path:
    """A transformers SAM 2 folder (``Sam2Model`` weights and config, ``Sam2Processor``) with random weights, seeded
    (the global RNG is left as it was). Returns ``out``."""
    import torch
    from transformers import Sam2Config, Sam2ImageProcessor, Sam2Model, Sam2Processor

    parts, side = sam2_parts(size)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Sam2Model(Sam2Config(**parts)).eval()
    out = Path(out)
    model.save_pretrained(out)
    size_hw = {"height": side, "width": side}
    mask_hw = {"height": side // 4, "width": side // 4}
    Sam2Processor(Sam2ImageProcessor(size=size_hw, mask_size=mask_hw)).save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=SIZES, default="tiny")
    ap.add_argument("--out", required=True, help="folder to write (the masker's foreground.path)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    print(save_random_sam2(args.out, args.size, args.seed))


if __name__ == "__main__":
    main()
