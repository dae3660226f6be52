"""Painters: repaint everything but the kept foreground of a canvas, from a text description.

A painter receives a batch of :class:`PaintJob` (canvas, kept-foreground mask, description, seed) and returns one
canvas-sized uint8 RGB array per job. It may touch any pixel: the worker pastes the foreground back exactly and audits
the result afterwards (``synth.compose``), so a painter cannot break a label. Picked by name in the server config
(``painter.name``); the rest of the ``painter`` block is the constructor's keyword arguments.

- ``procedural`` (:class:`ProceduralPainter`, default): CPU, no weights; draws the description grammar of
  ``core.toy.grammar`` (background texture and colour, distractor shapes) around the foreground.
- ``diffusers`` (:class:`DiffusersOutpainter`): SDXL + ControlNet inpaint or ControlNet-Union (ProMax) inpaint, as
  in the paper. The mask given to the pipeline is everything but the foreground (the old background and the
  extended canvas); the control image is the canvas with that area blacked out (the ProMax "repaint" convention).
- ``instruct`` (:class:`InstructionEditPainter`): an instruction image-edit pipeline (Qwen-Image-Edit, the seed's
  model, or InstructPix2Pix) for instruction edit jobs on real images: ``edit_images`` instead of ``paint``.
- ``"package.module:Class"``: any importable class with the same ``paint`` / ``load`` methods (and ``edit_images``
  to serve instruction edit jobs).

torch and diffusers are imported only inside :class:`DiffusersOutpainter`, so this module is cheap to import.
"""

from __future__ import annotations

import hashlib
import importlib
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
from PIL import Image

from core.toy import grammar
from synth import random_instruct
from synth.random_sdxl import build_random_sdxl_components


@dataclass
class PaintJob:
    """One canvas to paint. Arrays are canvas-sized: ``[H, W, 3]`` uint8 and ``[H, W]`` bool."""

    job_id: str
    canvas: np.ndarray
    """The input image placed on the canvas (the extension, if any, is filled with black)."""
    keep: np.ndarray
    """True on foreground pixels, which survive painting exactly (pasted back afterwards)."""
    known: np.ndarray
    """True where the canvas holds input pixels, False on the extended canvas."""
    description: str
    seed: int


class Painter(Protocol):
    name: str

    def load(self) -> None:
        """Heavy set-up (weights, device); called once in the worker process before the first job."""
        ...

    def paint(self, jobs: Sequence[PaintJob]) -> list[np.ndarray]:
        """One uint8 ``[H, W, 3]`` image per job, each the size of its canvas."""
        ...


def text_seed(text: str) -> int:
    """A stable 63-bit integer from a string (sha256; unlike ``hash()``, the same in every process)."""
    return int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:8], "little") >> 1


class ProceduralPainter:
    """Renders the description grammar around the foreground with ``core.toy.grammar.render`` (CPU, no weights).

    Deterministic: the same canvas, mask, description and seed give the same pixels. A description the grammar does
    not parse (``parse_description`` returns None) is replaced by ``random_description`` drawn from a generator seeded
    with :func:`text_seed` of the text, so any text maps to one fixed, valid scene description; the job's seed then
    drives the rendering as usual.

    Args:
        delay_s: extra seconds to sleep per job, to stand in for a slow generator in tests and load experiments.
    """

    name = "procedural"

    def __init__(self, delay_s: float = 0.0, device: str | None = None):
        self.delay_s = delay_s
        self.device = device  # unused: procedural painting is CPU only
        self._grammar = None

    def load(self) -> None:
        self._grammar = grammar

    def description_for(self, text: str):
        """The grammar's description of ``text``, or the deterministic stand-in for text it does not understand."""
        if self._grammar is None:
            self.load()
        d = self._grammar.parse_description(text)
        if d is None:
            d = self._grammar.random_description(np.random.default_rng(text_seed(text)))
        return d

    def paint(self, jobs: Sequence[PaintJob]) -> list[np.ndarray]:
        if self._grammar is None:
            self.load()
        out = []
        for job in jobs:
            if self.delay_s > 0:
                time.sleep(self.delay_s)
            image = self._grammar.render(
                Image.fromarray(job.canvas),
                keep_mask=job.keep,
                description=self.description_for(job.description),
                seed=job.seed,
            )
            out.append(np.asarray(image.convert("RGB"), dtype=np.uint8))
        return out


PIPELINES = {
    "union_inpaint": ("StableDiffusionXLControlNetUnionInpaintPipeline", "ControlNetUnionModel"),
    "controlnet_inpaint": ("StableDiffusionXLControlNetInpaintPipeline", "ControlNetModel"),
}


class DiffusersOutpainter:
    """SDXL ControlNet (Union) inpainting of the background and the extended canvas, batched.

    Args:
        model: SDXL base, a hub id or a local directory (``stabilityai/stable-diffusion-xl-base-1.0``).
        controlnet: the ControlNet, a hub id or a local directory.
        vae: optional replacement VAE (``madebyollin/sdxl-vae-fp16-fix`` for fp16).
        pipeline: ``union_inpaint`` (ControlNet-Union ProMax, control mode ``control_mode``) or ``controlnet_inpaint``.
        local_files_only: never touch the network (the default); pre-download the weights into the HF cache or
            point ``model`` / ``controlnet`` / ``vae`` at local directories.
        variant: weights variant of ``model`` (e.g. ``fp16``).
        tiny: build a tiny random-weight pipeline instead of loading one (tests; ``model`` etc. are ignored).
        device: torch device; the worker fills in its own.
        dtype: ``auto`` (bf16 on CUDA, fp32 on CPU), ``bfloat16``, ``float16`` or ``float32``.
        steps: denoising steps.
        guidance_scale: classifier-free guidance (1 disables the unconditional pass).
        controlnet_conditioning_scale: weight of the ControlNet residuals.
        strength: inpainting strength. 1 (the default) starts the repainted area from pure noise and runs exactly
            ``steps`` steps; diffusers' own default 0.9999 would run ``int(steps * 0.9999)`` (7 of 8).
        resolution: working size. An int is the long side (aspect kept, sides rounded to ``multiple_of``); a pair
            ``[w, h]`` is a fixed size; None keeps the canvas size (rounded). Results are resized back to the canvas.
        multiple_of: side multiple of the working size (SDXL needs 8; 64 keeps every UNet level even).
        max_batch: most canvases per pipeline call (jobs of different working sizes go in separate calls).
        prompt_template: the prompt, with ``{description}`` replaced by the job's description.
        negative_prompt: the negative prompt.
        control_mode: ControlNet-Union mode (7 = repaint in ProMax).
        control_fill: grey level written into the repaint area of the control image.
        compile: ``torch.compile`` the UNet and ControlNet (first batches of each shape are slow).
    """

    name = "diffusers"

    def __init__(
        self,
        model: str | None = None,
        controlnet: str | None = None,
        vae: str | None = None,
        pipeline: str = "union_inpaint",
        local_files_only: bool = True,
        variant: str | None = None,
        tiny: bool = False,
        device: str | None = None,
        dtype: str = "auto",
        steps: int = 25,
        guidance_scale: float = 5.0,
        controlnet_conditioning_scale: float = 1.0,
        strength: float = 1.0,
        resolution: int | Sequence[int] | None = 1024,
        multiple_of: int = 64,
        max_batch: int = 4,
        prompt_template: str = "{description}",
        negative_prompt: str = "blurry, low quality, distorted, watermark, text",
        control_mode: int = 7,
        control_fill: int = 0,
        compile: bool = False,
    ):
        if pipeline not in PIPELINES:
            raise ValueError(f"painter.pipeline must be one of {sorted(PIPELINES)}, got {pipeline!r}")
        if not tiny and (not model or not controlnet):
            raise ValueError(
                "painter.model and painter.controlnet are required (hub ids or local paths) unless painter.tiny"
            )
        if steps < 1:
            raise ValueError(f"painter.steps must be >= 1, got {steps}")
        if multiple_of < 8 or multiple_of % 8:
            raise ValueError(f"painter.multiple_of must be a multiple of 8, got {multiple_of}")
        if resolution is not None and not isinstance(resolution, int):
            resolution = tuple(int(v) for v in resolution)
            if len(resolution) != 2 or any(v % 8 for v in resolution):
                raise ValueError(f"painter.resolution must be an int or [w, h] with multiples of 8, got {resolution}")
        self.model, self.controlnet, self.vae, self.pipeline_kind = model, controlnet, vae, pipeline
        self.local_files_only, self.variant, self.tiny = local_files_only, variant, tiny
        self.device, self.dtype_name = device, dtype
        self.steps, self.guidance_scale, self.cond_scale = steps, guidance_scale, controlnet_conditioning_scale
        self.strength, self.resolution, self.multiple_of, self.max_batch = strength, resolution, multiple_of, max_batch
        self.prompt_template, self.negative_prompt = prompt_template, negative_prompt
        self.control_mode, self.control_fill, self.compile = control_mode, control_fill, compile
        self.pipe = None

    # -- construction ---------------------------------------------------------------------------------------------

    @classmethod
    def from_components(cls, components: dict[str, Any], pipeline: str = "union_inpaint", **kwargs: Any):
        """A painter around a pipeline built from in-memory modules (``synth.random_sdxl`` in tests and the bench)."""
        painter = cls(pipeline=pipeline, tiny=True, **kwargs)
        painter.pipe = painter._assemble(components)
        return painter

    def _torch_dtype(self):
        import torch

        device = self._device()
        name = self.dtype_name
        if name == "auto":
            name = "bfloat16" if device.startswith("cuda") else "float32"
        if name not in ("bfloat16", "float16", "float32"):
            raise ValueError(f"painter.dtype must be auto, bfloat16, float16 or float32, got {name!r}")
        return getattr(torch, name)

    def _device(self) -> str:
        if self.device:
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    def _assemble(self, components: dict[str, Any]):
        import diffusers

        diffusers.utils.logging.set_verbosity_error()
        pipe_cls = getattr(diffusers, PIPELINES[self.pipeline_kind][0])
        return self._finish(pipe_cls(**components))

    def _finish(self, pipe):
        pipe = pipe.to(self._device())
        pipe.set_progress_bar_config(disable=True)
        if self._device().startswith("cuda"):
            import torch

            for name in ("unet", "controlnet", "vae"):  # NHWC convolutions (cuDNN's fast path on tensor cores)
                module = getattr(pipe, name, None)
                if module is not None:
                    module.to(memory_format=torch.channels_last)
        if self.compile:
            import torch

            pipe.unet = torch.compile(pipe.unet)
            pipe.controlnet = torch.compile(pipe.controlnet)
        return pipe

    def load(self) -> None:
        if self.pipe is not None:
            return
        import diffusers

        dtype = self._torch_dtype()
        if self.tiny:
            comps = build_random_sdxl_components(
                "tiny", union=self.pipeline_kind == "union_inpaint", device=self._device(), dtype=dtype
            )
            self.pipe = self._assemble(comps)
            return
        diffusers.utils.logging.set_verbosity_error()
        pipe_name, cn_name = PIPELINES[self.pipeline_kind]
        common = dict(torch_dtype=dtype, local_files_only=self.local_files_only)
        try:
            controlnet = getattr(diffusers, cn_name).from_pretrained(self.controlnet, **common)
            extra = {}
            if self.vae:
                extra["vae"] = diffusers.AutoencoderKL.from_pretrained(self.vae, **common)
            pipe = getattr(diffusers, pipe_name).from_pretrained(
                self.model, controlnet=controlnet, variant=self.variant, **common, **extra
            )
        except (OSError, ValueError) as e:
            where = (
                "local_files_only=True: download the weights first (huggingface-cli download <id>) or set "
                "painter.model / painter.controlnet / painter.vae to local directories"
                if self.local_files_only
                else "check the hub ids and the network"
            )
            raise RuntimeError(
                f"could not load the SDXL painter (model={self.model!r}, controlnet={self.controlnet!r}, "
                f"vae={self.vae!r}) with {where}: {e}"
            ) from e
        self.pipe = self._finish(pipe)

    # -- painting -------------------------------------------------------------------------------------------------

    def working_size(self, width: int, height: int) -> tuple[int, int]:
        """The size the pipeline runs at for a canvas of ``width x height``."""
        m = self.multiple_of
        if isinstance(self.resolution, tuple):
            return self.resolution
        long_side = max(width, height) if self.resolution is None else self.resolution
        s = long_side / max(width, height)
        return max(m, _round_multiple(width * s, m)), max(m, _round_multiple(height * s, m))

    def paint(self, jobs: Sequence[PaintJob]) -> list[np.ndarray]:
        if self.pipe is None:
            self.load()
        out: list[np.ndarray | None] = [None] * len(jobs)
        groups: dict[tuple[int, int], list[int]] = {}
        for i, job in enumerate(jobs):
            h, w = job.keep.shape
            groups.setdefault(self.working_size(w, h), []).append(i)
        for size, idx in groups.items():
            for k in range(0, len(idx), self.max_batch):
                chunk = idx[k : k + self.max_batch]
                for i, img in zip(chunk, self._paint_batch([jobs[i] for i in chunk], size)):
                    out[i] = img
        return out  # type: ignore[return-value]

    def _paint_batch(self, jobs: Sequence[PaintJob], size: tuple[int, int]) -> list[np.ndarray]:
        import torch

        w, h = size
        images, masks, controls = [], [], []
        for job in jobs:
            repaint = ~job.keep
            control = job.canvas.copy()
            control[repaint] = self.control_fill
            # cv2's area / nearest resizes: a few ms per canvas where PIL's Lanczos took tens (the GPU waits on these)
            images.append(Image.fromarray(_resize(job.canvas, size)))
            masks.append(Image.fromarray(_resize(repaint.astype(np.uint8) * 255, size, nearest=True)))
            controls.append(Image.fromarray(_resize(control, size)))
        device = self.pipe._execution_device
        gen_device = "cpu" if getattr(device, "type", str(device)) == "mps" else device
        generators = [torch.Generator(device=gen_device).manual_seed(int(j.seed)) for j in jobs]
        kwargs: dict[str, Any] = dict(
            prompt=[self.prompt_template.format(description=j.description) for j in jobs],
            negative_prompt=[self.negative_prompt] * len(jobs),
            image=images,
            mask_image=masks,
            height=h,
            width=w,
            num_inference_steps=self.steps,
            guidance_scale=self.guidance_scale,
            controlnet_conditioning_scale=self.cond_scale,
            strength=self.strength,
            generator=generators,
            original_size=(h, w),
            target_size=(h, w),
            output_type="np",  # float [B, H, W, 3] in [0, 1]: no PIL round trip
        )
        if self.pipeline_kind == "union_inpaint":
            # One control image per control mode; the batch of them goes in as a [B, 3, H, W] tensor in [0, 1].
            batch = np.stack([np.asarray(c, dtype=np.float32) / 255.0 for c in controls])  # [B, H, W, 3]
            kwargs["control_image"] = [torch.from_numpy(batch).permute(0, 3, 1, 2).contiguous()]
            kwargs["control_mode"] = [self.control_mode]
        else:
            kwargs["control_image"] = controls
        with torch.inference_mode():
            result = self.pipe(**kwargs).images
        result = (np.clip(np.asarray(result, dtype=np.float32), 0.0, 1.0) * 255).round().astype(np.uint8)
        return [_resize(img, (j.keep.shape[1], j.keep.shape[0])) for img, j in zip(result, jobs)]


HALF_TOLERANCE = 0.02
"""`_round_multiple` rounds up from this far below a half: a side within 0.02 multiples of a half rounds as the half
does. An outpainted canvas is its image grown by a factor and rounded to whole pixels, so its aspect jitters by a pixel
around the image's; a 640 x 480 photo at a 640 working side sits exactly on a half (480 / 64 = 7.5), and plain
rounding split a batch of its extended canvases into 448 and 512 working heights: two pipeline calls where one does
(bench/e2e_gpu.py --server-variants, 2026-12-05: 1.9 images/s instead of 3.1)."""


def _round_multiple(value: float, m: int) -> int:
    """``value`` rounded to a multiple of ``m``, halves (and values up to `HALF_TOLERANCE` multiples below) up."""
    return int(math.floor(value / m + 0.5 + HALF_TOLERANCE)) * m


def _resize(image: np.ndarray, size: tuple[int, int], nearest: bool = False) -> np.ndarray:
    """``image`` [H, W(, C)] uint8 resized to ``size`` = (w, h): area averaging down, bicubic up, nearest for masks."""
    import cv2

    w, h = size
    if image.shape[1] == w and image.shape[0] == h:
        return np.ascontiguousarray(image)
    if nearest:
        interp = cv2.INTER_NEAREST
    else:
        interp = cv2.INTER_AREA if w * h < image.shape[0] * image.shape[1] else cv2.INTER_CUBIC
    return cv2.resize(np.ascontiguousarray(image), (w, h), interpolation=interp)


INSTRUCTION_PIPELINES = {
    "qwen_image_edit": "QwenImageEditPipeline",
    "instruct_pix2pix": "StableDiffusionInstructPix2PixPipeline",
}


class InstructionEditPainter:
    """An instruction image-edit pipeline (EvolvedGRPO's image edits): the whole image is edited after the job's
    instruction. Serves instruction edit jobs only (``edit_images``); a repaint job fails with a clear error.

    Weights load with ``from_pretrained(model, local_files_only=True)`` only: never a download at run time.

    Args:
        model: the pipeline's folder (e.g. a local snapshot of Qwen/Qwen-Image-Edit, or of timbrooks/instruct-pix2pix).
        pipeline: ``qwen_image_edit`` (the seed's model, 20B MMDiT + Qwen2.5-VL encoder; one image per call) or
            ``instruct_pix2pix`` (Stable Diffusion 1.5 sized, batched).
        tiny: build a tiny random-weight pipeline of the same kind instead (``synth.random_instruct``; tests,
            ``model`` is ignored).
        device: torch device; the worker fills in its own.
        dtype: ``auto`` (bf16 on CUDA, fp32 on CPU), ``bfloat16``, ``float16`` or ``float32``.
        steps: denoising steps.
        guidance_scale: text guidance (InstructPix2Pix).
        image_guidance_scale: image guidance (InstructPix2Pix; higher keeps more of the input).
        true_cfg_scale: classifier-free guidance of Qwen-Image-Edit (the seed uses 4).
        negative_prompt: the negative prompt.
        prompt_suffix: appended to every instruction (the seed appends a "preserve every answer-relevant detail"
            sentence, see configs/synth/qwen_image_edit.yaml).
        resolution: long side of the working size (aspect kept, sides multiples of ``multiple_of``); None: the
            image's own size, rounded. Results are resized back to the input's size.
        multiple_of: side multiple of the working size.
        max_batch: most images per pipeline call (Qwen-Image-Edit always 1).
    """

    name = "instruct"

    def __init__(
        self,
        model: str | None = None,
        pipeline: str = "qwen_image_edit",
        tiny: bool = False,
        device: str | None = None,
        dtype: str = "auto",
        steps: int = 30,
        guidance_scale: float = 7.5,
        image_guidance_scale: float = 1.5,
        true_cfg_scale: float = 4.0,
        negative_prompt: str = " ",
        prompt_suffix: str = "",
        resolution: int | None = 1024,
        multiple_of: int = 16,
        max_batch: int = 4,
    ):
        if pipeline not in INSTRUCTION_PIPELINES:
            raise ValueError(f"painter.pipeline must be one of {sorted(INSTRUCTION_PIPELINES)}, got {pipeline!r}")
        if not tiny and not model:
            raise ValueError(
                "painter.model is required (a local folder with the pipeline's weights) unless painter.tiny"
            )
        if steps < 1 or max_batch < 1 or multiple_of < 8 or multiple_of % 8:
            raise ValueError("painter.steps and painter.max_batch must be >= 1, painter.multiple_of a multiple of 8")
        self.model, self.pipeline_kind, self.tiny, self.device, self.dtype_name = model, pipeline, tiny, device, dtype
        self.steps, self.guidance_scale, self.image_guidance_scale = steps, guidance_scale, image_guidance_scale
        self.true_cfg_scale, self.negative_prompt, self.prompt_suffix = true_cfg_scale, negative_prompt, prompt_suffix
        self.resolution, self.multiple_of = resolution, multiple_of
        self.max_batch = 1 if pipeline == "qwen_image_edit" else max_batch
        self.pipe = None

    _device = DiffusersOutpainter._device
    _torch_dtype = DiffusersOutpainter._torch_dtype

    def load(self) -> None:
        if self.pipe is not None:
            return
        import diffusers

        diffusers.utils.logging.set_verbosity_error()
        dtype = self._torch_dtype()
        if self.tiny:
            build = (
                random_instruct.build_random_qwen_image_edit_components
                if self.pipeline_kind == "qwen_image_edit"
                else random_instruct.build_random_pix2pix_components
            )
            cls = getattr(diffusers, INSTRUCTION_PIPELINES[self.pipeline_kind])
            pipe = cls(**build(device=self._device(), dtype=dtype))
        else:
            cls = getattr(diffusers, INSTRUCTION_PIPELINES[self.pipeline_kind])
            try:
                pipe = cls.from_pretrained(self.model, dtype=dtype, local_files_only=True)
            except (OSError, ValueError) as e:
                raise RuntimeError(
                    f"could not load the {cls.__name__} painter from painter.model={self.model!r} with "
                    f"local_files_only=True: download it first (configs/synth/qwen_image_edit.yaml) and point "
                    f"painter.model at the folder: {e}"
                ) from e
        self.pipe = pipe.to(self._device())
        self.pipe.set_progress_bar_config(disable=True)

    def working_size(self, width: int, height: int) -> tuple[int, int]:
        m = self.multiple_of
        s = 1.0 if self.resolution is None else self.resolution / max(width, height)
        return max(m, _round_multiple(width * s, m)), max(m, _round_multiple(height * s, m))

    def paint(self, jobs: Sequence[PaintJob]) -> list[np.ndarray]:
        raise RuntimeError(
            "painter 'instruct' edits images after instructions only (edit.steps = [{kind: instruction}]); a repaint "
            "or inpaint job needs painter procedural or diffusers"
        )

    def edit_images(self, jobs: Sequence[PaintJob]) -> list[np.ndarray]:
        """One edited ``[H, W, 3]`` uint8 image per job (``job.description`` is the instruction), the canvas's size."""
        if self.pipe is None:
            self.load()
        out: list[np.ndarray | None] = [None] * len(jobs)
        groups: dict[tuple[int, int], list[int]] = {}
        for i, job in enumerate(jobs):
            h, w = job.canvas.shape[:2]
            groups.setdefault(self.working_size(w, h), []).append(i)
        for size, idx in groups.items():
            for k in range(0, len(idx), self.max_batch):
                chunk = idx[k : k + self.max_batch]
                for i, img in zip(chunk, self._edit_batch([jobs[i] for i in chunk], size)):
                    out[i] = img
        return out  # type: ignore[return-value]

    def _edit_batch(self, jobs: Sequence[PaintJob], size: tuple[int, int]) -> list[np.ndarray]:
        import torch

        w, h = size
        device = self.pipe._execution_device
        gen_device = "cpu" if getattr(device, "type", str(device)) == "mps" else device
        kwargs: dict[str, Any] = dict(
            prompt=[j.description + self.prompt_suffix for j in jobs],
            negative_prompt=[self.negative_prompt] * len(jobs),
            image=[Image.fromarray(_resize(j.canvas, size)) for j in jobs],
            num_inference_steps=self.steps,
            generator=[torch.Generator(device=gen_device).manual_seed(int(j.seed)) for j in jobs],
            output_type="np",  # float [B, H, W, 3] in [0, 1]
        )
        if self.pipeline_kind == "qwen_image_edit":
            kwargs.update(prompt=kwargs["prompt"][0], negative_prompt=kwargs["negative_prompt"][0],
                          image=kwargs["image"][0], height=h, width=w, true_cfg_scale=self.true_cfg_scale)  # fmt: skip
        else:
            kwargs.update(guidance_scale=self.guidance_scale, image_guidance_scale=self.image_guidance_scale)
        with torch.inference_mode():
            result = self.pipe(**kwargs).images
        result = (np.clip(np.asarray(result, dtype=np.float32), 0.0, 1.0) * 255).round().astype(np.uint8)
        return [_resize(img, (j.canvas.shape[1], j.canvas.shape[0])) for img, j in zip(result, jobs)]


PAINTERS: dict[str, type] = {
    "procedural": ProceduralPainter,
    "diffusers": DiffusersOutpainter,
    "instruct": InstructionEditPainter,
}


def build_painter(name: str = "procedural", device: str | None = None, **kwargs: Any) -> Painter:
    """Build a painter by registry name or ``"package.module:Class"`` import path; ``kwargs`` go to its constructor."""
    if name in PAINTERS:
        cls = PAINTERS[name]
    elif ":" in name:
        module, _, attr = name.partition(":")
        cls = getattr(importlib.import_module(module), attr)
    else:
        raise ValueError(f"painter.name must be one of {sorted(PAINTERS)} or 'package.module:Class', got {name!r}")
    return cls(device=device, **kwargs)
