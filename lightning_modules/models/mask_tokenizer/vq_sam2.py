"""VQ-SAM2: the released CycleGRPO / SAMTok mask tokenizer, rebuilt on transformers' SAM 2 classes.

Architecture (our reading of the released ``projects/transformers/vq_sam2``; ``mask_tokenizer_256x2``):

- **image**: resized to the SAM input square (1024, ignoring the aspect ratio, as the release's ``DirectResize``),
  scaled to [0, 1] and normalised with ImageNet's mean / std; SAM 2's Hiera encoder + FPN
  (``Sam2Model.get_image_embeddings``: three levels, the no-memory embedding added to the lowest resolution);
- **encoder** (``encode``): the box as two corner points (labels 2 and 3, SAM's box-corner embeddings, plus the
  padding point) and the mask resampled to the prompt encoder's 256 x 256 mask input go through SAM 2's prompt
  encoder; one learned token plus these sparse prompts attend to the image embedding (plus the dense mask prompt)
  through a *second* two-way transformer of the mask decoder's shape (the release's ``sam_mask_encoder``); the
  learned token's output is the latent ``z`` (256-d);
- **quantiser**: two unshared residual codebooks of 256 entries (``quantizer.ResidualQuantizer``);
- **decoder** (``decode``): the quantised latent is appended as one extra sparse prompt token after an empty point
  prompt, SAM 2's mask decoder runs with three candidate masks and the one of highest predicted IoU is kept; its
  256 x 256 logits are resized to the image and thresholded (0.5 on the logits, as the release's demo does).

Weights. ``VQSam2MaskTokenizer.from_files(sam2, tokenizer)`` reads

- ``sam2``: SAM 2.1 either as a transformers folder (``save_pretrained`` of ``facebook/sam2.1-hiera-large``) or as
  the original ``sam2.1_hiera_large.pt`` (a ``{"model": state_dict}`` in Meta's key layout, mapped here; the
  architecture then comes from ``config`` or ``hiera_large_config()``);
- ``tokenizer``: the release's ``mask_tokenizer_256x2.pth``, a ``state_dict`` of its ``VQ_SAM2`` module: SAM 2 under
  ``model.sam2_model.`` in Meta's layout (including ``sam_mask_encoder``), and ``quantizer.codebooks.{i}.weight``
  (``[257, 256]``: 256 codes and a padding row) with their EMA buffers.

``sam2_key_to_hf`` / ``hf_key_to_sam2`` map Meta's key names onto transformers' (the same renames as transformers'
own SAM 2 conversion: ``image_encoder.trunk`` -> ``vision_encoder.backbone``, ``mlp.layers.{0,1}`` -> ``proj_in`` /
``proj_out``, ``norm`` -> ``layer_norm``, the four point embeddings -> one matrix, ...); SAM 2's video modules
(memory attention / encoder, object pointers) have no place in an image tokenizer and are skipped, and reported.
Device and batching: ``VQSam2MaskTokenizer(net, device=...)`` / ``.to(device)`` runs it anywhere (CycleGRPO puts it
on the policy's device, or on ``mask_device``); ``decode_batch`` encodes each distinct image once and runs the mask
decoder on up to ``batch_size`` code pairs of it per call (``bench/mask_decode.py`` measures decodes/s).
Not done: loading the real files has not been tried (they are not available here); the tests save random weights of
a tiny configuration in the released layout and load them back (docs/mask_tokens.md, "Gaps").
"""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from lightning_modules.models.mask_tokenizer.base import Codes, MaskTokenizer, as_image, as_mask, tight_box
from lightning_modules.models.mask_tokenizer.quantizer import ResidualQuantizer

__all__ = [
    "RELEASED_PREFIX",
    "VQSam2MaskTokenizer",
    "VQSam2Net",
    "hf_key_to_sam2",
    "hiera_large_config",
    "load_released_state",
    "released_state_dict",
    "sam2_key_to_hf",
]

RELEASED_PREFIX = "model.sam2_model."
"""Where the release's ``VQ_SAM2`` keeps SAM 2 (Meta's layout) in its state dict."""
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

_VIDEO_ONLY = re.compile(
    r"^(memory_attention\.|memory_encoder\.|maskmem_tpos_enc|no_mem_pos_enc|no_obj_ptr|obj_ptr_proj\.|"
    r"obj_ptr_tpos_proj\.|mask_downsample\.|no_obj_embed_spatial)"
)
_MLP3 = r"(iou_prediction_head|output_hypernetworks_mlps\.\d+|pred_obj_score_head)"
_MLP3_NAMES = ("proj_in", "layers.0", "proj_out")
_DOWNSCALE = {"0": "conv1", "1": "layer_norm1", "3": "conv2", "4": "layer_norm2", "6": "conv3"}
_UPSCALE = {"0": "upscale_conv1", "1": "upscale_layer_norm", "3": "upscale_conv2"}


def _transformer_to_hf(rest: str) -> str:
    rest = re.sub(
        r"^layers\.(\d+)\.mlp\.layers\.([01])\.",
        lambda m: f"layers.{m[1]}.mlp.{('proj_in', 'proj_out')[int(m[2])]}.",
        rest,
    )
    rest = rest.replace(".out_proj.", ".o_proj.")
    rest = re.sub(r"(^|\.)norm(\d|_final_attn)", r"\1layer_norm\2", rest)
    return rest


def _transformer_to_sam2(rest: str) -> str:
    rest = re.sub(
        r"^layers\.(\d+)\.mlp\.(proj_in|proj_out)\.",
        lambda m: f"layers.{m[1]}.mlp.layers.{int(m[2] == 'proj_out')}.",
        rest,
    )
    rest = rest.replace(".o_proj.", ".out_proj.")
    rest = re.sub(r"(^|\.)layer_norm(\d|_final_attn)", r"\1norm\2", rest)
    return rest


def sam2_key_to_hf(key: str) -> str | None:
    """A key of Meta's SAM 2 (``RELEASED_PREFIX`` stripped) -> the key of ``VQSam2Net`` (``sam.`` + transformers'
    ``Sam2Model`` key, ``mask_encoder.`` / ``mask_encoder_tokens.`` for the release's mask encoder); None for a video
    module. ``sam_prompt_encoder.point_embeddings.{i}.weight`` maps to ``sam.prompt_encoder.point_embed.weight``
    (row ``i``: ``load_released_state`` stacks them)."""
    if _VIDEO_ONLY.match(key):
        return None
    if key == "no_mem_embed":
        return "sam.no_memory_embedding"
    if m := re.match(r"image_encoder\.trunk\.(.*)", key):
        rest = m[1].replace("patch_embed.proj.", "patch_embed.projection.")
        rest = re.sub(r"^blocks\.(\d+)\.norm([12])\.", r"blocks.\1.layer_norm\2.", rest)
        rest = re.sub(
            r"^blocks\.(\d+)\.mlp\.layers\.([01])\.",
            lambda m: f"blocks.{m[1]}.mlp.{('proj_in', 'proj_out')[int(m[2])]}.",
            rest,
        )
        return "sam.vision_encoder.backbone." + rest
    if m := re.match(r"image_encoder\.neck\.convs\.(\d+)\.conv\.(.*)", key):
        return f"sam.vision_encoder.neck.convs.{m[1]}.{m[2]}"
    if m := re.match(r"sam_prompt_encoder\.(.*)", key):
        rest = m[1]
        if rest == "pe_layer.positional_encoding_gaussian_matrix":
            return "sam.prompt_encoder.shared_embedding.positional_embedding"
        if re.match(r"point_embeddings\.\d+\.weight$", rest):
            return "sam.prompt_encoder.point_embed.weight"
        rest = re.sub(r"^mask_downscaling\.(\d)\.", lambda m: f"mask_embed.{_DOWNSCALE[m[1]]}.", rest)
        return "sam.prompt_encoder." + rest
    if m := re.match(r"sam_mask_decoder\.(.*)", key):
        rest = m[1]
        rest = re.sub(r"^output_upscaling\.(\d)\.", lambda m: f"{_UPSCALE[m[1]]}.", rest)
        rest = re.sub(rf"^{_MLP3}\.layers\.([012])\.", lambda m: f"{m[1]}.{_MLP3_NAMES[int(m[2])]}.", rest)
        if rest.startswith("transformer."):
            rest = "transformer." + _transformer_to_hf(rest[len("transformer.") :])
        return "sam.mask_decoder." + rest
    if m := re.match(r"sam_mask_encoder\.transformer\.(.*)", key):
        return "mask_encoder." + _transformer_to_hf(m[1])
    if key == "sam_mask_encoder.mask_tokens.weight":
        return "mask_encoder_tokens.weight"
    raise KeyError(f"unknown SAM 2 key {key!r}: not in the released VQ-SAM2 layout this loader reads")


def hf_key_to_sam2(key: str) -> str | None:
    """The inverse of ``sam2_key_to_hf`` (None for keys with no counterpart: ``sam.shared_image_embedding``, a copy
    of the prompt encoder's Gaussian matrix, and the stacked point embeddings, written by ``released_state_dict``)."""
    if key in ("sam.shared_image_embedding.positional_embedding", "sam.prompt_encoder.point_embed.weight"):
        return None
    if key == "sam.no_memory_embedding":
        return "no_mem_embed"
    if m := re.match(r"sam\.vision_encoder\.backbone\.(.*)", key):
        rest = m[1].replace("patch_embed.projection.", "patch_embed.proj.")
        rest = re.sub(r"^blocks\.(\d+)\.layer_norm([12])\.", r"blocks.\1.norm\2.", rest)
        rest = re.sub(
            r"^blocks\.(\d+)\.mlp\.(proj_in|proj_out)\.",
            lambda m: f"blocks.{m[1]}.mlp.layers.{int(m[2] == 'proj_out')}.",
            rest,
        )
        return "image_encoder.trunk." + rest
    if m := re.match(r"sam\.vision_encoder\.neck\.convs\.(\d+)\.(.*)", key):
        return f"image_encoder.neck.convs.{m[1]}.conv.{m[2]}"
    if m := re.match(r"sam\.prompt_encoder\.(.*)", key):
        rest = m[1]
        if rest == "shared_embedding.positional_embedding":
            return "sam_prompt_encoder.pe_layer.positional_encoding_gaussian_matrix"
        inv = {v: k for k, v in _DOWNSCALE.items()}
        rest = re.sub(r"^mask_embed\.(\w+)\.", lambda m: f"mask_downscaling.{inv[m[1]]}.", rest)
        return "sam_prompt_encoder." + rest
    if m := re.match(r"sam\.mask_decoder\.(.*)", key):
        rest = m[1]
        inv = {v: k for k, v in _UPSCALE.items()}
        rest = re.sub(
            r"^(upscale_conv1|upscale_layer_norm|upscale_conv2)\.", lambda m: f"output_upscaling.{inv[m[1]]}.", rest
        )
        rest = re.sub(
            rf"^{_MLP3}\.(proj_in|layers\.0|proj_out)\.", lambda m: f"{m[1]}.layers.{_MLP3_NAMES.index(m[2])}.", rest
        )
        if rest.startswith("transformer."):
            rest = "transformer." + _transformer_to_sam2(rest[len("transformer.") :])
        return "sam_mask_decoder." + rest
    if m := re.match(r"mask_encoder\.(.*)", key):
        return "sam_mask_encoder.transformer." + _transformer_to_sam2(m[1])
    if key == "mask_encoder_tokens.weight":
        return "sam_mask_encoder.mask_tokens.weight"
    raise KeyError(f"no released-layout name for {key!r}")


def hiera_large_config():
    """transformers' ``Sam2Config`` of SAM 2.1 Hiera-L (the release's ``sam2.1_hiera_l.yaml``), for reading the
    original ``sam2.1_hiera_large.pt`` without a transformers ``config.json``."""
    from transformers import Sam2Config

    backbone = dict(
        model_type="sam2_hiera_det_model",
        hidden_size=144,
        num_attention_heads=2,
        embed_dim_per_stage=[144, 288, 576, 1152],
        num_attention_heads_per_stage=[2, 4, 8, 16],
        blocks_per_stage=[2, 6, 36, 4],
        global_attention_blocks=[23, 33, 43],
        window_positional_embedding_background_size=[7, 7],
        window_size_per_stage=[8, 4, 16, 8],
    )
    vision = dict(backbone_config=backbone, backbone_channel_list=[1152, 576, 288, 144])
    return Sam2Config(vision_config=vision)


def tiny_config():
    """A 64-pixel SAM 2 of a few blocks (random weights in the tests and ``bench/mask_decode.py --size tiny``): the
    same classes as Hiera-L, small enough to decode in milliseconds on one CPU thread."""
    from transformers import Sam2Config

    backbone = dict(
        model_type="sam2_hiera_det_model",
        hidden_size=16,
        num_attention_heads=1,
        image_size=[64, 64],
        blocks_per_stage=[1, 1, 2, 1],
        embed_dim_per_stage=[16, 32, 64, 128],
        num_attention_heads_per_stage=[1, 1, 1, 1],
        window_size_per_stage=[4, 4, 4, 2],
        global_attention_blocks=[3],
        window_positional_embedding_background_size=[2, 2],
    )
    vision = dict(
        backbone_config=backbone,
        backbone_channel_list=[128, 64, 32, 16],
        backbone_feature_sizes=[[16, 16], [8, 8], [4, 4]],
        fpn_hidden_size=32,
    )
    return Sam2Config(
        vision_config=vision,
        prompt_encoder_config=dict(hidden_size=32, image_size=64, patch_size=16),
        mask_decoder_config=dict(hidden_size=32, mlp_dim=64, num_attention_heads=2, iou_head_hidden_dim=32),
    )


class VQSam2Net(nn.Module):
    """SAM 2 (``sam``) + the release's mask encoder (``mask_encoder``, ``mask_encoder_tokens``) + ``quantizer``."""

    def __init__(self, sam_config: Any, codebook_size: int = 256, num_codebooks: int = 2, sam: nn.Module | None = None):
        super().__init__()
        from transformers import Sam2Model
        from transformers.models.sam2.modeling_sam2 import Sam2TwoWayTransformer

        self.sam = sam if sam is not None else Sam2Model(sam_config)
        dec = self.sam.config.mask_decoder_config
        self.hidden = dec.hidden_size
        self.mask_encoder = Sam2TwoWayTransformer(dec)
        self.mask_encoder_tokens = nn.Embedding(1, self.hidden)
        self.quantizer = ResidualQuantizer(num_codebooks, codebook_size, self.hidden)

    @property
    def input_size(self) -> int:
        return int(self.sam.config.prompt_encoder_config.image_size)

    def features(self, pixel_values: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Image embeddings (three FPN levels, ``Sam2Model.get_image_embeddings``) and the dense positional
        embedding ``[B, C, h, w]``."""
        emb = self.sam.get_image_embeddings(pixel_values)
        pe = self.sam.get_image_wide_positional_embeddings().repeat(pixel_values.shape[0], 1, 1, 1)
        return emb, pe

    def encode_latent(self, pixel_values: torch.Tensor, masks: torch.Tensor, boxes: torch.Tensor) -> torch.Tensor:
        """``masks [B, 1, h, w]`` float (resampled to the prompt encoder's mask input unless already that size),
        ``boxes [B, 4]`` in input-square pixels -> ``z [B, C]``."""
        emb, pe = self.features(pixel_values)
        b = pixel_values.shape[0]
        size = tuple(self.sam.prompt_encoder.mask_input_size)
        if tuple(masks.shape[-2:]) != size:
            masks = F.interpolate(masks.float(), size=size, mode="bilinear", align_corners=False, antialias=True)
        points = boxes.view(b, 1, 2, 2)
        labels = torch.tensor([2, 3], dtype=torch.int32, device=boxes.device).expand(b, 1, 2)
        sparse, dense = self.sam.prompt_encoder(
            input_points=points, input_labels=labels, input_boxes=None, input_masks=masks.to(pixel_values.dtype)
        )  # sparse [B, 1, 3, C]: two corners + the padding point
        tokens = torch.cat([self.mask_encoder_tokens.weight.expand(b, 1, 1, -1), sparse], 2)
        queries, _ = self.mask_encoder(
            point_embeddings=tokens,
            image_embeddings=emb[-1] + dense,
            image_positional_embeddings=pe,
            attention_similarity=None,
        )
        return queries[:, 0, 0]

    def decode_features(self, emb: list[torch.Tensor], pe: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        """Quantised latents ``q [B, C]`` -> low-resolution mask logits ``[B, h, w]`` (best of three by IoU), from the
        image's features (`features`): each level ``[1 or B, ...]``, a single image's broadcast to the ``B`` latents, so
        the image encoder runs once for all codes of one image."""
        b = q.shape[0]
        emb = [e.expand(b, -1, -1, -1) for e in emb]
        pe = pe.expand(b, -1, -1, -1)
        points = torch.zeros(b, 1, 1, 2, dtype=emb[-1].dtype, device=q.device)
        labels = -torch.ones(b, 1, 1, dtype=torch.int32, device=q.device)
        sparse, dense = self.sam.prompt_encoder(
            input_points=points, input_labels=labels, input_boxes=None, input_masks=None
        )  # [B, 1, 2, C]: the empty point + the padding point
        sparse = torch.cat([sparse, q[:, None, None, :].to(sparse.dtype)], 2)
        masks, iou, _, _ = self.sam.mask_decoder(
            image_embeddings=emb[-1],
            image_positional_embeddings=pe,
            sparse_prompt_embeddings=sparse,
            dense_prompt_embeddings=dense,
            multimask_output=True,
            high_resolution_features=emb[:-1],
        )  # masks [B, 1, 3, h, w], iou [B, 1, 3]
        best = iou[:, 0].argmax(-1)
        return masks[torch.arange(b), 0, best]


def released_state_dict(net: VQSam2Net) -> dict[str, torch.Tensor]:
    """``net``'s weights in the release's ``VQ_SAM2`` layout (what ``mask_tokenizer_256x2.pth`` holds)."""
    out: dict[str, torch.Tensor] = {}
    for key, value in net.state_dict().items():
        if key.startswith("quantizer."):
            continue
        name = hf_key_to_sam2(key)
        if name is not None:
            out[RELEASED_PREFIX + name] = value.clone()
    for i, row in enumerate(net.sam.prompt_encoder.point_embed.weight.detach()):
        out[f"{RELEASED_PREFIX}sam_prompt_encoder.point_embeddings.{i}.weight"] = row[None].clone()
    q = net.quantizer
    for k in range(q.depth):
        pad = torch.zeros(1, q.dim, dtype=q.embed.dtype)
        out[f"quantizer.codebooks.{k}.weight"] = torch.cat([q.embed[k], pad])
        out[f"quantizer.codebooks.{k}.cluster_size_ema"] = q.cluster_size[k].clone()
        out[f"quantizer.codebooks.{k}.embed_ema"] = q.embed_sum[k].clone()
    return out


@torch.no_grad()
def load_released_state(net: VQSam2Net, state: dict[str, torch.Tensor], *, require_quantizer: bool = True) -> dict:
    """Copy a release-layout state dict (``model.sam2_model.`` keys and / or bare Meta SAM 2 keys, and
    ``quantizer.codebooks.*``) into ``net``. Returns ``{"loaded": n, "skipped_video": [...], "missing": [...]}``
    (``missing``: ``net`` keys the state did not cover). Raises on a shape mismatch, an unknown key, or (with
    ``require_quantizer``) absent codebooks."""
    own = net.state_dict()
    loaded, skipped, points = set(), [], {}
    for raw, value in state.items():
        if raw.startswith("quantizer."):
            continue
        key = raw[len(RELEASED_PREFIX) :] if raw.startswith(RELEASED_PREFIX) else raw
        if m := re.match(r"sam_prompt_encoder\.point_embeddings\.(\d+)\.weight$", key):
            points[int(m[1])] = value
            continue
        name = sam2_key_to_hf(key)
        if name is None:
            skipped.append(raw)
            continue
        if name not in own or own[name].shape != value.shape:
            got = tuple(value.shape)
            want = tuple(own[name].shape) if name in own else "no such parameter"
            raise ValueError(f"released key {raw!r} -> {name!r}: shape {got} does not fit {want}")
        own[name].copy_(value)
        loaded.add(name)
    if points:
        stacked = torch.cat([points[i] for i in sorted(points)])
        own["sam.prompt_encoder.point_embed.weight"].copy_(stacked)
        loaded.add("sam.prompt_encoder.point_embed.weight")
    if "sam.prompt_encoder.shared_embedding.positional_embedding" in loaded:
        own["sam.shared_image_embedding.positional_embedding"].copy_(
            own["sam.prompt_encoder.shared_embedding.positional_embedding"]
        )
        loaded.add("sam.shared_image_embedding.positional_embedding")
    q = net.quantizer
    books = sorted({int(m[1]) for k in state if (m := re.match(r"quantizer\.codebooks\.(\d+)\.weight$", k))})
    if books:
        if books != list(range(q.depth)):
            raise ValueError(f"the released state has codebooks {books}, the tokenizer {q.depth}")
        for k in books:
            weight = state[f"quantizer.codebooks.{k}.weight"]
            if tuple(weight.shape) != (q.size + 1, q.dim):
                raise ValueError(
                    f"quantizer.codebooks.{k}.weight is {tuple(weight.shape)}, want ({q.size + 1}, {q.dim})"
                )
            q.embed[k] = weight[: q.size]
            q.embed_sum[k] = state.get(f"quantizer.codebooks.{k}.embed_ema", weight[: q.size])
            q.cluster_size[k] = state.get(f"quantizer.codebooks.{k}.cluster_size_ema", torch.ones(q.size))
        q.initted.fill_(True)
        loaded.update(k for k in own if k.startswith("quantizer."))
    elif require_quantizer:
        raise ValueError("no quantizer.codebooks.*.weight in the tokenizer state: is it mask_tokenizer_256x2.pth?")
    missing = sorted(k for k in own if k not in loaded and not k.startswith("quantizer."))
    return {"loaded": len(loaded), "skipped_video": skipped, "missing": missing}


def _read_state(path: Path) -> dict[str, torch.Tensor]:
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path))
    state = torch.load(str(path), map_location="cpu", weights_only=True)
    return state.get("model", state) if isinstance(state, dict) else state


class VQSam2MaskTokenizer(MaskTokenizer):
    """``MaskTokenizer`` over a ``VQSam2Net`` (module docstring); ``threshold`` on the resized logits.

    Runs on ``device`` (``to(device)`` moves it; images go there, masks come back as numpy). ``decode_batch`` runs the
    image encoder once per distinct image (by object: a bound mask space passes the same array for all its spans) and
    SAM 2's mask decoder on up to ``batch_size`` code pairs of that image at a time; ``n_decoded`` / ``n_images``
    count the code pairs and image encodings decoded so far and ``seconds`` the wall time of ``encode`` / ``decode``
    calls (each ends by copying its result to the host, so the time includes the device's work): the benchmark's and
    the tests' counters."""

    def __init__(
        self, net: VQSam2Net, threshold: float = 0.5, device: str | torch.device = "cpu", batch_size: int = 32
    ):
        if batch_size < 1:
            raise ValueError(
                f"VQSam2MaskTokenizer(batch_size=...) must be >= 1 code pairs per decoder call, got {batch_size}"
            )
        self.net = net.eval()
        self.threshold = threshold
        self.batch_size = batch_size
        self.codebook_size = net.quantizer.size
        self.num_codebooks = net.quantizer.depth
        self.device = torch.device("cpu")
        self.n_decoded = self.n_images = 0
        self.seconds = {"encode": 0.0, "decode": 0.0}
        self.to(device)

    def to(self, device: str | torch.device) -> VQSam2MaskTokenizer:
        """Move the network to ``device`` (a no-op when it is there); returns self."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if device != self.device:
            self.net.to(device)
            self.device = device
        return self

    @classmethod
    def from_files(
        cls,
        sam2: str | Path,
        tokenizer: str | Path | None = None,
        *,
        config: Any = None,
        threshold: float = 0.5,
        device: str | torch.device = "cpu",
    ) -> VQSam2MaskTokenizer:
        """SAM 2 from ``sam2`` (a transformers folder, or Meta's ``.pt`` with ``config`` or Hiera-L), then the release's
        tokenizer state from ``tokenizer`` (module docstring). Local files only; raises one clear error per missing
        file."""
        sam2 = Path(sam2)
        if sam2.is_dir():
            from transformers import Sam2Model

            if not (sam2 / "config.json").is_file():
                raise FileNotFoundError(f"{sam2}: no config.json (a transformers SAM 2 folder, save_pretrained layout)")
            sam = Sam2Model.from_pretrained(str(sam2), local_files_only=True, dtype=torch.float32)
            net = VQSam2Net(sam.config, sam=sam)
        elif sam2.is_file():
            net = VQSam2Net(config if config is not None else hiera_large_config())
            report = load_released_state(net, _read_state(sam2), require_quantizer=False)
            sam_missing = [k for k in report["missing"] if k.startswith("sam.")]
            if sam_missing:
                raise ValueError(f"{sam2}: {len(sam_missing)} SAM 2 weights missing, e.g. {sam_missing[:3]}")
        else:
            raise FileNotFoundError(
                f"SAM 2 weights not found at {str(sam2)!r}: a transformers folder of facebook/sam2.1-hiera-large or "
                "the original sam2.1_hiera_large.pt (docs/mask_tokens.md)"
            )
        if tokenizer is not None:
            tokenizer = Path(tokenizer)
            if not tokenizer.is_file():
                raise FileNotFoundError(
                    f"mask tokenizer weights not found at {str(tokenizer)!r} (mask_tokenizer_256x2.pth)"
                )
            load_released_state(net, _read_state(tokenizer))
        return cls(net, threshold, device)

    def _pixels(self, images: Sequence[Any]) -> tuple[torch.Tensor, list[tuple[int, int]]]:
        from PIL import Image

        s = self.net.input_size
        mean = torch.tensor(IMAGENET_MEAN)[:, None, None]
        std = torch.tensor(IMAGENET_STD)[:, None, None]
        out, sizes = [], []
        for im in images:
            arr = as_image(im)
            sizes.append(arr.shape[:2])
            resized = np.asarray(Image.fromarray(arr).resize((s, s)), dtype=np.float32) / 255.0
            out.append((torch.from_numpy(resized).permute(2, 0, 1) - mean) / std)
        return torch.stack(out).to(self.device), sizes

    @torch.no_grad()
    def encode_batch(self, images, masks, boxes=None) -> list[Codes]:
        t0 = time.perf_counter()
        pixels, sizes = self._pixels(images)
        boxes = list(boxes) if boxes is not None else [None] * len(images)
        s = self.net.input_size
        size = tuple(self.net.sam.prompt_encoder.mask_input_size)
        ms, bs = [], []
        for (h, w), m, b in zip(sizes, masks, boxes):
            mask = as_mask(m, (h, w))
            box = tight_box(mask) if b is None else tuple(float(v) for v in b)
            if box is None:
                raise ValueError("an empty mask has no tokens: it is NO_TARGET")
            # straight from the image's pixels to the prompt encoder's mask input (antialiased, as the release)
            m = torch.from_numpy(mask.astype(np.float32))[None, None]
            ms.append(F.interpolate(m, size=size, mode="bilinear", align_corners=False, antialias=True))
            bs.append([box[0] * s / w, box[1] * s / h, box[2] * s / w, box[3] * s / h])
        z = self.net.encode_latent(
            pixels, torch.cat(ms).to(self.device), torch.tensor(bs, dtype=torch.float32, device=self.device)
        )
        out = [(int(a), int(b)) for a, b in self.net.quantizer.encode(z).tolist()]
        self.seconds["encode"] += time.perf_counter() - t0
        return out

    @torch.no_grad()
    def decode_batch(self, codes, images) -> list[np.ndarray]:
        if len(codes) != len(images):
            raise ValueError(
                f"decode_batch takes one image per code pair, got {len(codes)} codes, {len(images)} images"
            )
        t0 = time.perf_counter()
        checked = [self.check_codes(c) for c in codes]
        by_image: dict[int, list[int]] = {}  # one image encoding per distinct image object
        for i, im in enumerate(images):
            by_image.setdefault(id(im), []).append(i)
        out: list[np.ndarray | None] = [None] * len(codes)
        for rows in by_image.values():
            pixels, ((h, w),) = self._pixels([images[rows[0]]])
            emb, pe = self.net.features(pixels)  # [1, ...] per level
            self.n_images += 1
            for start in range(0, len(rows), self.batch_size):
                chunk = rows[start : start + self.batch_size]
                q = self.net.quantizer.lookup(torch.tensor([checked[i] for i in chunk], device=self.device))
                logits = self.net.decode_features(emb, pe, q)[:, None].float()  # [b, 1, h', w']
                full = F.interpolate(logits, size=(h, w), mode="bilinear", align_corners=False)[:, 0]
                for i, mask in zip(chunk, (full > self.threshold).cpu().numpy()):
                    out[i] = mask
                self.n_decoded += len(chunk)
        self.seconds["decode"] += time.perf_counter() - t0
        return out
