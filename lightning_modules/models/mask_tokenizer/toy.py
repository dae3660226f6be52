"""The toy world's VQ mask tokenizer: a few hundred kilobytes, trained on CPU in minutes (``python -m
cli.mask_tokenizer``), with the released VQ-SAM2's contract (image + mask + box -> two codes; codes + image -> mask).

Architecture (``ToyVQNet``; shapes for a batch of B masks, ``R = config.crop`` = 32):

- **encoder**: the box crop of ``[mask, image RGB]`` resampled to ``[B, 4, R, R]`` -> three stride-2 convs -> flatten,
  concatenated with the normalised box ``(x1, y1, x2, y2) / size`` and the mask's mean colour -> MLP -> ``z [B, D]``;
- **bottleneck**: ``ResidualQuantizer`` (2 unshared EMA codebooks of 256 entries, straight-through, commitment loss,
  k-means initialisation after a warm-up without quantisation, dead-code restarts);
- **decoder**, from the quantised latent ``q [B, D]`` and the image: an MLP predicts the box (centre, log size) and
  a prior mask ``[B, 1, R, R]`` in the *frame* of that box grown by ``config.margin`` on each side; the image is
  resampled into the same frame and a small conv net, FiLM-conditioned on ``q``, refines the prior into the final
  logits. The frame is pasted back onto the image's pixels by bilinear sampling of the logits (threshold 0).

Why the image in the decoder: two codes (65,536 values) cannot say where a 20-pixel shape lies on a 224-pixel image
to the pixel; they say roughly where and what, and the image gives the edges, as SAM's decoder reads the image
features. The codes alone identify the object in the scene, so the captioning prompt can show them and the grounding
answer can be them (no box beside them).

On disk (``save`` / ``load``): ``config.json`` (``ToyVQConfig`` plus a ``format`` tag) and ``model.safetensors``
(the net and the codebooks, fp32).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from lightning_modules.models.mask_tokenizer.base import Codes, MaskTokenizer, as_image, as_mask, tight_box
from lightning_modules.models.mask_tokenizer.quantizer import ResidualQuantizer

__all__ = ["FORMAT", "ToyMaskTokenizer", "ToyVQConfig", "ToyVQNet", "frame_grid"]

FORMAT = "toy-vq-mask-tokenizer/1"
"""``config.json``'s ``format``: what ``load`` accepts."""


@dataclass(frozen=True)
class ToyVQConfig:
    """The toy tokenizer's shape (``config.json``)."""

    crop: int = 32
    """Side of the encoder's box crop and of the decoder's frame, in cells."""
    width: int = 32
    """Channels of the convs."""
    latent: int = 64
    """Dimension D of the latent and of the codebook entries."""
    codebook_size: int = 256
    num_codebooks: int = 2
    margin: float = 0.25
    """The decoder's frame is its predicted box grown by this fraction of the box's size on each side."""


def frame_grid(boxes: torch.Tensor, size: int, image_hw: tuple[int, int], margin: float = 0.0) -> torch.Tensor:
    """``grid_sample`` grid ``[B, size, size, 2]`` sampling the (grown) pixel boxes ``[B, 4]`` of an image
    ``image_hw`` at ``size x size`` cell centres (``align_corners=False`` coordinates)."""
    h, w = image_hw
    x1, y1, x2, y2 = boxes.unbind(1)
    bw, bh = (x2 - x1).clamp(min=1.0), (y2 - y1).clamp(min=1.0)
    x1, x2 = x1 - margin * bw, x2 + margin * bw
    y1, y2 = y1 - margin * bh, y2 + margin * bh
    t = (torch.arange(size, dtype=boxes.dtype, device=boxes.device) + 0.5) / size  # [size]
    xs = x1[:, None] + t[None] * (x2 - x1)[:, None]  # [B, size] pixel x of each cell centre
    ys = y1[:, None] + t[None] * (y2 - y1)[:, None]
    gx = (2 * xs / w - 1)[:, None, :].expand(-1, size, -1)
    gy = (2 * ys / h - 1)[:, :, None].expand(-1, -1, size)
    return torch.stack([gx, gy], -1)


def _paste_grid(boxes: torch.Tensor, size: int, image_hw: tuple[int, int], margin: float) -> torch.Tensor:
    """The inverse of ``frame_grid``: for every image pixel centre, its position in the frame's
    ``[-1, 1]`` coordinates (outside the frame: beyond +-1, sampled as zero padding)."""
    h, w = image_hw
    x1, y1, x2, y2 = boxes.unbind(1)
    bw, bh = (x2 - x1).clamp(min=1.0), (y2 - y1).clamp(min=1.0)
    x1, x2 = x1 - margin * bw, x2 + margin * bw
    y1, y2 = y1 - margin * bh, y2 + margin * bh
    px = torch.arange(w, dtype=boxes.dtype, device=boxes.device) + 0.5
    py = torch.arange(h, dtype=boxes.dtype, device=boxes.device) + 0.5
    gx = (2 * (px[None] - x1[:, None]) / (x2 - x1)[:, None] - 1)[:, None, :].expand(-1, h, -1)
    gy = (2 * (py[None] - y1[:, None]) / (y2 - y1)[:, None] - 1)[:, :, None].expand(-1, -1, w)
    return torch.stack([gx, gy], -1)


class ToyVQNet(nn.Module):
    """The tokenizer's weights and its forward passes (module docstring)."""

    def __init__(self, config: ToyVQConfig):
        super().__init__()
        self.config = config
        c, r, d = config.width, config.crop, config.latent
        self.enc_conv = nn.Sequential(
            nn.Conv2d(4, c, 3, stride=2, padding=1),
            nn.GELU(),
            nn.Conv2d(c, 2 * c, 3, stride=2, padding=1),
            nn.GELU(),
            nn.Conv2d(2 * c, 2 * c, 3, stride=2, padding=1),
            nn.GELU(),
        )
        flat = 2 * c * (r // 8) ** 2
        self.enc_mlp = nn.Sequential(nn.Linear(flat + 7, 256), nn.GELU(), nn.Linear(256, d))
        self.quantizer = ResidualQuantizer(config.num_codebooks, config.codebook_size, d)
        self.dec_mlp = nn.Sequential(nn.Linear(d, 256), nn.GELU())
        self.dec_box = nn.Linear(256, 4)
        nn.init.zeros_(self.dec_box.weight)
        nn.init.zeros_(self.dec_box.bias)
        self.dec_prior = nn.Linear(256, (r // 4) ** 2)
        self.ref_in = nn.Conv2d(4 + 2, c, 3, padding=1)
        self.ref_convs = nn.ModuleList([nn.Conv2d(c, c, 3, padding=1) for _ in range(2)])
        self.film = nn.Linear(d, 2 * c * 3)
        self.ref_out = nn.Conv2d(c, 1, 3, padding=1)
        coords = torch.linspace(-1, 1, r)
        self.register_buffer(
            "coords", torch.stack(torch.meshgrid(coords, coords, indexing="ij"))[None], persistent=False
        )

    # --- encoder ------------------------------------------------------------------------------------------------

    def encode_latent(self, images: torch.Tensor, masks: torch.Tensor, boxes: torch.Tensor) -> torch.Tensor:
        """``images [B, 3, H, W]`` in [0, 1], ``masks [B, 1, H, W]`` float, ``boxes [B, 4]`` pixels -> ``z [B, D]``
        (layer-normalised without affine, so the codebooks see a fixed scale)."""
        h, w = images.shape[-2:]
        grid = frame_grid(boxes, self.config.crop, (h, w))
        m = F.grid_sample(masks, grid, mode="bilinear", align_corners=False)  # [B, 1, R, R]
        im = F.grid_sample(images, grid, mode="bilinear", align_corners=False)  # [B, 3, R, R]
        feats = self.enc_conv(torch.cat([m, im], 1)).flatten(1)
        colour = (im * m).sum((2, 3)) / m.sum((2, 3)).clamp(min=1e-3)  # [B, 3] mean colour under the mask
        scale = boxes.new_tensor([w, h, w, h])
        z = self.enc_mlp(torch.cat([feats, boxes / scale, colour], 1))
        return F.layer_norm(z, (z.shape[1],))

    # --- decoder ------------------------------------------------------------------------------------------------

    def decode_box(self, hidden: torch.Tensor, image_hw: tuple[int, int]) -> torch.Tensor:
        """The predicted box ``[B, 4]`` in pixels: centre ``(0.5 + u) x side``, size ``0.15 x exp(v) x side``."""
        h, w = image_hw
        cx, cy, lw, lh = self.dec_box(hidden).unbind(1)
        cx, cy = (0.5 + cx) * w, (0.5 + cy) * h
        bw, bh = 0.15 * torch.exp(lw.clamp(-4, 2)) * w, 0.15 * torch.exp(lh.clamp(-4, 2)) * h
        return torch.stack([cx - bw / 2, cy - bh / 2, cx + bw / 2, cy + bh / 2], 1)

    def decode_frame(
        self, q: torch.Tensor, images: torch.Tensor, frame: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``q [B, D]``, ``images [B, 3, H, W]`` -> (the frame's box ``[B, 4]``, prior logits and refined logits
        ``[B, 1, R, R]`` in the frame of that box grown by the margin). The frame is the predicted box unless
        ``frame`` (boxes ``[B, 4]``, training's jittered true boxes) is given."""
        r, margin = self.config.crop, self.config.margin
        hidden = self.dec_mlp(q)
        box = self.decode_box(hidden, images.shape[-2:]) if frame is None else frame
        side = r // 4
        prior = self.dec_prior(hidden).view(-1, 1, side, side)
        prior = F.interpolate(prior, size=(r, r), mode="bilinear", align_corners=False)
        grid = frame_grid(box.detach(), r, images.shape[-2:], margin)
        crop = F.grid_sample(images, grid, mode="bilinear", align_corners=False)
        x = torch.cat([crop, prior, self.coords.expand(q.shape[0], -1, -1, -1)], 1)
        gamma_beta = self.film(q).view(q.shape[0], 3, 2, -1, 1, 1)
        x = self.ref_in(x)
        for i, conv in enumerate([None, *self.ref_convs]):
            if conv is not None:
                x = conv(x)
            x = F.gelu(x * (1 + gamma_beta[:, i, 0]) + gamma_beta[:, i, 1])
        return box, prior, prior + self.ref_out(x)

    def paste(self, box: torch.Tensor, logits: torch.Tensor, image_hw: tuple[int, int]) -> torch.Tensor:
        """Frame logits ``[B, 1, R, R]`` of the grown boxes -> image logits ``[B, H, W]`` (outside the frame: -inf
        in effect, a large negative value)."""
        grid = _paste_grid(box, self.config.crop, image_hw, self.config.margin)
        out = F.grid_sample(logits + 100.0, grid, mode="bilinear", padding_mode="zeros", align_corners=False)
        return out[:, 0] - 100.0


class ToyMaskTokenizer(MaskTokenizer):
    """``MaskTokenizer`` over a ``ToyVQNet`` (CPU, fp32, no gradient)."""

    def __init__(self, net: ToyVQNet):
        self.net = net.eval()
        self.codebook_size = net.config.codebook_size
        self.num_codebooks = net.config.num_codebooks

    # --- disk ---------------------------------------------------------------------------------------------------

    def save(self, out_dir: str | Path, extra: dict[str, Any] | None = None) -> Path:
        from safetensors.torch import save_file

        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().contiguous().cpu() for k, v in self.net.state_dict().items()}
        state["quantizer.initted"] = state["quantizer.initted"].to(torch.uint8)
        save_file(state, str(out / "model.safetensors"), metadata={"format": FORMAT})
        config = {"format": FORMAT, **dataclasses.asdict(self.net.config), **(extra or {})}
        (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        return out

    @classmethod
    def load(cls, path: str | Path) -> ToyMaskTokenizer:
        from safetensors.torch import load_file

        path = Path(path)
        if not (path / "config.json").is_file() or not (path / "model.safetensors").is_file():
            raise FileNotFoundError(
                f"no toy mask tokenizer at {str(path)!r} (config.json + model.safetensors); build it with "
                "`python -m cli.mask_tokenizer --out checkpoints/toy-mask-tokenizer`"
            )
        raw = json.loads((path / "config.json").read_text())
        if raw.get("format") != FORMAT:
            raise ValueError(f"{path}/config.json: format {raw.get('format')!r} is not {FORMAT!r}")
        names = {f.name for f in dataclasses.fields(ToyVQConfig)}
        net = ToyVQNet(ToyVQConfig(**{k: v for k, v in raw.items() if k in names}))
        state = load_file(str(path / "model.safetensors"))
        state["quantizer.initted"] = state["quantizer.initted"].to(torch.bool)
        net.load_state_dict(state)
        return cls(net)

    # --- MaskTokenizer ------------------------------------------------------------------------------------------

    @staticmethod
    def _images(images: Sequence[Any]) -> list[torch.Tensor]:
        return [torch.from_numpy(as_image(im).copy()).permute(2, 0, 1).float() / 255.0 for im in images]

    @torch.no_grad()
    def encode_batch(self, images, masks, boxes=None) -> list[Codes]:
        if len(images) != len(masks):
            raise ValueError(f"encode_batch takes one mask per image, got {len(images)} images, {len(masks)} masks")
        boxes = list(boxes) if boxes is not None else [None] * len(images)
        out: list[Codes] = []
        for im, m, b in zip(self._images(images), masks, boxes):
            mask = as_mask(m, tuple(im.shape[-2:]))
            box = tight_box(mask) if b is None else tuple(float(v) for v in b)
            if box is None:
                raise ValueError("an empty mask has no tokens: it is NO_TARGET (the region spaces write 'no target')")
            mt = torch.from_numpy(mask.astype(np.float32))[None, None]
            z = self.net.encode_latent(im[None], mt, torch.tensor([box], dtype=torch.float32))
            c1, c2 = self.net.quantizer.encode(z)[0].tolist()
            out.append((int(c1), int(c2)))
        return out

    @torch.no_grad()
    def decode_batch(self, codes, images) -> list[np.ndarray]:
        if len(codes) != len(images):
            raise ValueError(
                f"decode_batch takes one image per code pair, got {len(codes)} codes, {len(images)} images"
            )
        out = []
        for c, im in zip(codes, self._images(images)):
            q = self.net.quantizer.lookup(torch.tensor([self.check_codes(c)]))
            box, _, logits = self.net.decode_frame(q, im[None])
            out.append((self.net.paste(box, logits, tuple(im.shape[-2:]))[0] > 0).numpy())
        return out

    def n_parameters(self) -> int:
        return sum(p.numel() for p in self.net.parameters()) + self.net.quantizer.embed.numel()


def mask_iou(a: np.ndarray, b: np.ndarray) -> float:
    """Pixel IoU of two bool masks (1.0 when both are empty)."""
    union = np.count_nonzero(a | b)
    return 1.0 if union == 0 else np.count_nonzero(a & b) / union
