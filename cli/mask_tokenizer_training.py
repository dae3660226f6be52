"""Training and measuring the toy VQ mask tokenizer on exact toy-world masks (``python -m cli.mask_tokenizer``, its only
user: a build step run outside any fit, so it sits beside that command rather than with the tokenizer).

Data: every visible object (target, other foreground objects, painted distractors) of toy scenes, its exact visible
mask (``core.toy.masks``) and tight box. Training scenes come from ``TRAIN_SPLITS``, held-out ones from
``EVAL_SPLITS``; the toy world's splits never share scenes (each split's code enters its seed).

Schedule: ``warmup`` steps as a plain autoencoder (no quantisation), then k-means initialisation of both codebooks
on the latents of a few batches, then training through the quantiser. Loss per batch:
``BCE + Dice`` of the refined logits and ``0.5 BCE`` of the prior against the true mask resampled into the decoder's
frame, ``10 x L1`` of the predicted box (in units of the image side) and ``0.25 x`` the commitment loss. Adam,
cosine decay. Deterministic on CPU for a fixed seed and thread count.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from core.toy.masks import mask_box
from core.toy.scene import owner_map
from datamodules.toy import make_scene
from lightning_modules.models.mask_tokenizer.toy import ToyMaskTokenizer, ToyVQConfig, ToyVQNet, frame_grid

__all__ = ["EVAL_SPLITS", "TRAIN_SPLITS", "MaskSet", "ToyTrainArgs", "build_mask_set", "evaluate", "train_toy"]

TRAIN_SPLITS = ("train", "varied", "crowded")
EVAL_SPLITS = ("val", "test_ood", "test_ood_crowded")


@dataclass
class MaskSet:
    """Objects of toy scenes: ``images [N_img, 3, H, W]`` uint8, ``owners [N_img, H, W]`` int16 (object index per
    pixel, ``scene.owner_map``), and per object its image, its index in the scene and its tight box ``[N, 4]``."""

    images: torch.Tensor
    owners: torch.Tensor
    image_index: torch.Tensor
    object_index: torch.Tensor
    boxes: torch.Tensor

    def __len__(self) -> int:
        return int(self.image_index.shape[0])

    def batch(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(images [B, 3, H, W] in [0, 1], masks [B, 1, H, W] float, boxes [B, 4])`` of objects ``idx``."""
        img = self.image_index[idx]
        images = self.images[img].float() / 255.0
        masks = (self.owners[img] == self.object_index[idx][:, None, None]).float()[:, None]
        return images, masks, self.boxes[idx]


def build_mask_set(splits: Sequence[str], n_scenes: int, seed: int, size: int = 224) -> MaskSet:
    """The visible objects of ``n_scenes`` toy scenes drawn round-robin from ``splits``."""
    images, owners, image_index, object_index, boxes = [], [], [], [], []
    for i in range(n_scenes):
        rec = make_scene(splits[i % len(splits)], i // len(splits), seed, size=size)
        meta = rec["meta"]
        owner = owner_map(meta)
        for k in range(len(meta["objects"])):
            box = mask_box(owner == k)
            if box is None:  # wholly covered: nothing to segment
                continue
            image_index.append(len(images))
            object_index.append(k)
            boxes.append(box)
        images.append(np.asarray(rec["image"].convert("RGB")).transpose(2, 0, 1))
        owners.append(owner.astype(np.int16))
    return MaskSet(
        images=torch.from_numpy(np.stack(images)),
        owners=torch.from_numpy(np.stack(owners)),
        image_index=torch.tensor(image_index),
        object_index=torch.tensor(object_index, dtype=torch.int16),
        boxes=torch.tensor(boxes, dtype=torch.float32),
    )


@dataclass
class ToyTrainArgs:
    """How the toy tokenizer is trained (``cli.mask_tokenizer`` flags)."""

    steps: int = 1500
    warmup: int = 200
    batch_size: int = 48
    lr: float = 2e-3
    train_scenes: int = 1200
    eval_masks: int = 512
    seed: int = 0
    config: ToyVQConfig = field(default_factory=ToyVQConfig)
    log_every: int = 100


def _dice(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    p = torch.sigmoid(logits).flatten(1)
    t = target.flatten(1)
    return (1 - (2 * (p * t).sum(1) + 1) / (p.sum(1) + t.sum(1) + 1)).mean()


def _jitter(boxes: torch.Tensor, amount: float, generator) -> torch.Tensor:
    """Boxes moved and resized by up to ``amount`` of their size (the decoder's frame must tolerate an imprecise
    predicted box)."""
    wh = (boxes[:, 2:] - boxes[:, :2]).repeat(1, 2)
    return boxes + (torch.rand(boxes.shape, generator=generator) * 2 - 1) * amount * wh


def _loss(net: ToyVQNet, images, masks, boxes, quantize: bool, generator) -> tuple[torch.Tensor, dict[str, float]]:
    """Half the batch decodes in the frame of its predicted box, half in a jittered true box (so the refinement
    learns to find the object in an imprecise frame from the start, before the box head is good)."""
    h, w = images.shape[-2:]
    z = net.encode_latent(images, masks, boxes)
    if quantize:
        q, commit, _ = net.quantizer(z, generator)
    else:
        q, commit = z, z.new_zeros(())
    pred_box = net.decode_box(net.dec_mlp(q), (h, w))
    teacher = (torch.arange(len(boxes)) % 2 == 1)[:, None]
    frame = torch.where(teacher, _jitter(boxes, 0.15, generator), pred_box.detach())
    _, prior, logits = net.decode_frame(q, images, frame)
    grid = frame_grid(frame, net.config.crop, (h, w), net.config.margin)
    target = F.grid_sample(masks, grid, mode="bilinear", align_corners=False)
    scale = boxes.new_tensor([w, h, w, h])
    own = ~teacher[:, 0]  # the prior lives in the predicted box's frame
    l_mask = F.binary_cross_entropy_with_logits(logits, target) + _dice(logits, target)
    l_prior = F.binary_cross_entropy_with_logits(prior[own], target[own])
    l_box = (pred_box / scale - boxes / scale).abs().mean()
    loss = l_mask + 0.5 * l_prior + 10.0 * l_box + 0.25 * commit
    return loss, {"mask": l_mask.item(), "box": l_box.item(), "commit": commit.item()}


def train_toy(args: ToyTrainArgs, log=print) -> tuple[ToyMaskTokenizer, dict[str, float]]:
    """Train a toy tokenizer from scratch; returns it and the held-out round-trip metrics (``evaluate``)."""
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    t0 = time.perf_counter()
    data = build_mask_set(TRAIN_SPLITS, args.train_scenes, args.seed)
    log(f"train set: {len(data)} masks from {args.train_scenes} scenes ({time.perf_counter() - t0:.1f} s)")
    net = ToyVQNet(args.config)
    opt = torch.optim.Adam(net.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 50) * 0.5 * (1 + math.cos(math.pi * min(s / max(args.steps, 1), 1.0)))
    )
    net.train()
    for step in range(args.steps):
        if step == args.warmup:
            with torch.no_grad():
                idx = torch.randperm(len(data), generator=gen)[: min(len(data), 2048)]
                z = torch.cat([net.encode_latent(*data.batch(part)) for part in idx.split(256)])
                net.quantizer.init_from(z, gen)
        idx = torch.randint(0, len(data), (args.batch_size,), generator=gen)
        loss, parts = _loss(net, *data.batch(idx), quantize=step >= args.warmup, generator=gen)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        opt.step()
        sched.step()
        if args.log_every and (step % args.log_every == 0 or step == args.steps - 1):
            used = [int(torch.count_nonzero(net.quantizer.idle[k] < 10)) for k in range(net.quantizer.depth)]
            log(
                f"step {step:5d}  loss {loss.item():.4f}  mask {parts['mask']:.4f}  box {parts['box']:.4f}  "
                f"commit {parts['commit']:.4f}  codes used in the last 10 steps {used}  ({time.perf_counter() - t0:.0f} s)"
            )
    net.eval()
    tok = ToyMaskTokenizer(net)
    held_out = build_mask_set(EVAL_SPLITS, max(1, args.eval_masks // 2), args.seed)
    metrics = evaluate(tok, held_out, args.eval_masks, seed=args.seed)
    metrics["train_seconds"] = round(time.perf_counter() - t0, 1)
    return tok, metrics


@torch.no_grad()
def evaluate(tok: ToyMaskTokenizer, data: MaskSet, n: int, seed: int = 0) -> dict[str, float]:
    """Round-trip pixel IoU (encode -> two codes -> decode, against the exact mask) on the first ``n`` objects of
    ``data`` (a fixed permutation); also small (< 32 px box side) / large splits and the code usage."""
    net = tok.net
    order = torch.randperm(len(data), generator=torch.Generator().manual_seed(seed))[:n]
    ious, sides, codes = [], [], []
    for part in order.split(128):
        images, masks, boxes = data.batch(part)
        z = net.encode_latent(images, masks, boxes)
        c = net.quantizer.encode(z)
        box, _, logits = net.decode_frame(net.quantizer.lookup(c), images)
        pred = net.paste(box, logits, images.shape[-2:]) > 0
        gt = masks[:, 0] > 0.5
        inter = (pred & gt).flatten(1).sum(1).float()
        union = (pred | gt).flatten(1).sum(1).float()
        ious.append(inter / union.clamp(min=1))
        sides.append(torch.maximum(boxes[:, 2] - boxes[:, 0], boxes[:, 3] - boxes[:, 1]))
        codes.append(c)
    iou, side, codes = torch.cat(ious), torch.cat(sides), torch.cat(codes)
    small = side < 32
    return {
        "n_masks": int(iou.numel()),
        "miou": round(float(iou.mean()), 4),
        "miou_small": round(float(iou[small].mean()), 4) if small.any() else float("nan"),
        "miou_large": round(float(iou[~small].mean()), 4) if (~small).any() else float("nan"),
        "iou_p10": round(float(iou.quantile(0.1)), 4),
        "frac_iou_ge_0.9": round(float((iou >= 0.9).float().mean()), 4),
        "codes_used_1": int(codes[:, 0].unique().numel()),
        "codes_used_2": int(codes[:, 1].unique().numel()),
        "distinct_pairs": int(torch.unique(codes, dim=0).shape[0]),
    }
