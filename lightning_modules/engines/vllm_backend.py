"""What runs vLLM for the ``vllm`` rollout engine (``engines/vllm.py``), in the trainer process or in a vLLM server.

- the wire format both modes share: `SampleRequest` / `SampleResponse` (prompts, images or clips as base64 PNG,
  sampling; prompt ids, completion ids, their log-probs), and `vllm_inputs`, vLLM's prompts processed as
  `qwen_vl.processor_inputs` processes them;
- `VLLMGenerator`: a ``vllm.LLM`` that answers a `SampleRequest` and reloads weights in place (the ``colocate``
  backend, and what ``engines/vllm_server.py`` serves);
- `VLLMServerClient`: the thin HTTP client of that server, with the same ``generate`` / ``load_weights``;
- `export_weights` / `weights_fingerprint`: the policy's weights as vLLM takes them, and whether they changed.

vLLM itself is imported only when a generator starts (`import_vllm`): it lives in its own environment (docs/vllm.md).
"""

from __future__ import annotations

import base64
import io
import os
import shutil
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from pydantic import BaseModel

from core.video import VideoClip, clip_pixel_budget, video_processor_kwargs

__all__ = [
    "VLLMGenerator",
    "VLLMServerClient",
    "SampleRequest",
    "SampleResponse",
    "ReloadRequest",
    "EncodedClip",
    "UnsupportedClipError",
    "import_vllm",
    "export_weights",
    "weights_fingerprint",
]


VLLM_MISSING = (
    "--model.engines.rollout_engine vllm needs the vllm package, which this Python environment ({python}) does not have. "
    "vLLM pins its own torch / transformers, so it lives in a separate environment: build .venv-vllm with "
    "`make vllm-venv` and run from it (.venv-vllm/bin/python train.py fit ...); docs/vllm.md."
)


def import_vllm():
    """``import vllm`` with an error that says where vLLM is installed in this project."""
    try:
        import vllm
    except ImportError as err:
        import sys

        raise ImportError(VLLM_MISSING.format(python=sys.executable)) from err
    return vllm


class UnsupportedClipError(ValueError):
    """Video clips sent to a vLLM that would sample them at other positions than the update scores (any model but
    Qwen2.5-VL, whose positions `vllm_qwen` replaces, and Qwen3-VL, whose positions vLLM computes as transformers);
    the message says why and which engine to use instead."""

    def __init__(self, arch: str):
        super().__init__(
            f"the vllm rollout engine takes video clips for Qwen2.5-VL and Qwen3-VL checkpoints only, and this vLLM "
            f"runs {arch}: vLLM continues the text after a clip from max(positions) + 1 where transformers' forward "
            "(SFT, the update engines) may continue it from start + max(h, w) / merge (Qwen2-VL / Qwen2.5-VL: "
            "lightning_modules/engines/vllm_qwen.py replaces vLLM's positions for Qwen2.5-VL), so its rollouts would "
            "come from other positions than the ones the update scores. Use --model.engines.rollout_engine fast (or hf) for "
            "video prompts (docs/vllm.md)."
        )


# -------------------------------------------------------------------------------------------------- wire format
class EncodedClip(BaseModel):
    """A `VideoClip` on the wire: its frames as base64 PNG, and its frame rate."""

    frames: list[str]
    fps: float


class SampleRequest(BaseModel):
    """``n`` completions of each prompt (one visual per prompt: ``images`` base64 PNG, or ``videos`` clips), and the
    sampling semantics of `Sampling` with the ids to suppress / stop on (the same request in colocate and server
    mode)."""

    prompts: list[str]
    images: list[str] = []
    videos: list[EncodedClip] = []
    n: int
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 128
    min_tokens: int = 0
    greedy: bool = False
    stop_token_ids: list[int] = []
    suppress_ids: list[int] = []


class SampleResponse(BaseModel):
    """Per prompt: vLLM's prompt ids [P_i], its ``n`` completions' ids [T_ij] and their log-probs [T_ij] (raw: the
    full-vocabulary log-softmax at temperature 1, before suppression, temperature and top-p)."""

    prompt_token_ids: list[list[int]]
    completion_ids: list[list[list[int]]]
    logprobs: list[list[list[float]]]


class ReloadRequest(BaseModel):
    path: str
    """A directory of ``*.safetensors`` in the checkpoint's (Hugging Face) parameter names, readable by the server."""


def encode_image(image: Image.Image) -> str:
    """Lossless (PNG) base64, so the server sees the pixels the processor saw."""
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode("ascii")


def decode_image(data: str) -> Image.Image:
    return Image.open(io.BytesIO(base64.b64decode(data))).convert("RGB")


def encode_clip(clip: VideoClip) -> EncodedClip:
    return EncodedClip(frames=[encode_image(f) for f in clip.frames], fps=float(clip.fps))


def decode_clip(data: EncodedClip) -> VideoClip:
    return VideoClip([decode_image(f) for f in data.frames], fps=data.fps)


def video_item(clip: VideoClip) -> tuple:
    """``clip`` as vLLM's ``multi_modal_data["video"]`` takes it for Qwen-VL: the frames [T, H, W, 3] (uint8) and
    their metadata (the frame rate sets ``second_per_grid_ts``; every frame is a sampled one)."""
    import numpy as np

    frames = np.stack([np.asarray(f.convert("RGB")) for f in clip.frames])
    n = len(clip.frames)
    meta = {
        "fps": float(clip.fps),
        "duration": n / float(clip.fps),
        "total_num_frames": n,
        "frames_indices": list(range(n)),
        "video_backend": "pil",
        "do_sample_frames": False,
    }
    return frames, meta


def vllm_inputs(
    prompts: Sequence[str], visuals: Sequence[Image.Image | VideoClip], clip_grid: tuple[int, int] | None = None
) -> list[dict]:
    """vLLM's prompts for one visual per prompt, processed as `qwen_vl.processor_inputs` processes them: images as
    they are; clips with every frame kept and the pixel budget pinned to the batch's largest frame area, or, with
    ``clip_grid`` = (patch x merge pixels, temporal patch) of a model whose video processor budgets whole clips
    (Qwen3-VL), to the range of the clips' rounded sizes (`qwen_vl.clip_pixel_budget`)."""
    if len(visuals) != len(prompts):
        raise ValueError(f"one image or clip per prompt: got {len(visuals)} for {len(prompts)} prompts")
    clips = [isinstance(v, VideoClip) for v in visuals]
    if not any(clips):
        return [{"prompt": p, "multi_modal_data": {"image": im}} for p, im in zip(prompts, visuals)]
    if not all(clips):
        raise ValueError("one rollout batch holds images or video clips, not both: make one generate() call per kind")
    size = clip_pixel_budget(visuals, *clip_grid) if clip_grid else video_processor_kwargs(visuals)["size"]
    kwargs = {"size": size, "do_sample_frames": False}
    if clip_grid:  # Qwen3-VL: no per-frame cap on top of the budget, where transformers has one
        from transformers import Qwen3VLVideoProcessor

        if hasattr(Qwen3VLVideoProcessor, "cap_pixels_per_frame"):
            kwargs["cap_pixels_per_frame"] = False
    return [
        {"prompt": p, "multi_modal_data": {"video": video_item(c)}, "mm_processor_kwargs": dict(kwargs)}
        for p, c in zip(prompts, visuals)
    ]


# -------------------------------------------------------------------------------------------------- the vLLM side
def checkpoint_architecture(model_dir: str) -> str:
    """The first architecture a ``save_pretrained`` directory's config names (empty when none)."""
    import json

    archs = json.loads((Path(model_dir) / "config.json").read_text()).get("architectures") or [""]
    return archs[0]


QWEN3_VL_ARCH = "Qwen3VLForConditionalGeneration"


def checkpoint_clip_grid(model_dir: str) -> tuple[int, int]:
    """(patch x spatial merge in pixels, temporal patch) of a ``save_pretrained`` Qwen-VL directory's vision config."""
    import json

    v = json.loads((Path(model_dir) / "config.json").read_text()).get("vision_config") or {}
    return int(v.get("patch_size", 16)) * int(v.get("spatial_merge_size", 2)), int(v.get("temporal_patch_size", 2))


def checkpoint_dtype(model_dir: str) -> str:
    """The dtype a ``save_pretrained`` directory's config names (``float32`` when it names none)."""
    import json

    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    text_cfg = cfg.get("text_config") or {}
    dtype = cfg.get("dtype") or cfg.get("torch_dtype") or text_cfg.get("dtype") or text_cfg.get("torch_dtype")
    return str(dtype or "float32").removeprefix("torch.")


class VLLMGenerator:
    """A ``vllm.LLM`` that answers `SampleRequest` s and reloads weights in place: the colocate backend, and what the
    server wraps.

    The engine core runs in the calling process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, ``uni`` executor) so that
    weights can be handed over as tensors; ``kv_cache_memory_bytes`` (CPU: required, vLLM's memory fraction refuses
    to start there) or ``gpu_memory_utilization`` bound its memory.
    """

    def __init__(
        self,
        model: str,
        *,
        dtype: str = "auto",
        gpu_memory_utilization: float = 0.3,
        kv_cache_memory_bytes: int | None = None,
        enforce_eager: bool = True,
        max_model_len: int = 4096,
        seed: int = 0,
    ) -> None:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        vllm = import_vllm()
        if dtype == "auto":  # vLLM's own "auto" runs an fp32 checkpoint in 16 bits: take the checkpoint's dtype
            dtype = checkpoint_dtype(model)
        self.dtype = dtype
        if kv_cache_memory_bytes is None and not torch.cuda.is_available():
            kv_cache_memory_bytes = 512 << 20
        self.architecture = checkpoint_architecture(model)
        from lightning_modules.engines import vllm_qwen

        self.takes_clips = self.architecture in (vllm_qwen.BASE_ARCH, QWEN3_VL_ARCH)
        """Video clips are sampled at the positions the update scores: Qwen2.5-VL with the project's (`vllm_qwen`),
        Qwen3-VL with vLLM's own (each timestamped block of a clip placed like an image, the text after it from
        max + 1 = start + max(h, w) / merge, as transformers); other models refuse them."""
        self.clip_grid = checkpoint_clip_grid(model) if self.architecture == QWEN3_VL_ARCH else None
        """(patch x merge pixels, temporal patch) of a model whose video processor budgets whole clips."""
        kwargs: dict[str, Any] = dict(
            model=model,
            dtype=dtype,
            enforce_eager=enforce_eager,
            max_model_len=max_model_len,
            seed=seed,
            distributed_executor_backend="uni",
            limit_mm_per_prompt={"image": 1, "video": 1 if self.takes_clips else 0},
        )
        if self.architecture == vllm_qwen.BASE_ARCH:
            vllm_qwen.register()
            kwargs["hf_overrides"] = {"architectures": [vllm_qwen.ARCH]}
        if kv_cache_memory_bytes is not None:
            kwargs["kv_cache_memory_bytes"] = int(kv_cache_memory_bytes)
        else:
            kwargs["gpu_memory_utilization"] = gpu_memory_utilization
        self.model = model
        self.llm = vllm.LLM(**kwargs)
        self._SamplingParams = vllm.SamplingParams
        self.vocab_size = self.llm.llm_engine.model_config.get_vocab_size()
        self.weights = model
        """Where the weights vLLM holds came from (the model directory, the last reloaded path, or ``tensors``)."""

    def sampling_params(self, req: SampleRequest):
        suppress = set(req.suppress_ids)
        common = dict(
            n=req.n,
            max_tokens=req.max_tokens,
            min_tokens=req.min_tokens,
            stop_token_ids=list(req.stop_token_ids),
            logprobs=0,  # the sampled token's log-prob only
            allowed_token_ids=[i for i in range(self.vocab_size) if i not in suppress] if suppress else None,
            skip_special_tokens=False,
            detokenize=False,
        )
        if req.greedy:
            return self._SamplingParams(temperature=0.0, **common)
        return self._SamplingParams(temperature=req.temperature, top_p=req.top_p, top_k=0, **common)

    def generate(self, req: SampleRequest, images: Sequence[Image.Image | VideoClip] | None = None) -> SampleResponse:
        """Sample ``req``; ``images`` (PIL images or `VideoClip` s) stand in for ``req.images`` / ``req.videos`` in
        process (no PNG round trip)."""
        if images is None:
            images = [decode_clip(c) for c in req.videos] + [decode_image(s) for s in req.images]
        images = list(images)
        if any(isinstance(v, VideoClip) for v in images) and not self.takes_clips:
            raise UnsupportedClipError(self.architecture or "an unknown architecture")
        inputs = vllm_inputs(req.prompts, images, self.clip_grid)
        outs = self.llm.generate(inputs, self.sampling_params(req), use_tqdm=False)
        ids, lps = [], []
        for o in outs:
            comps = sorted(o.outputs, key=lambda c: c.index)
            ids.append([list(c.token_ids) for c in comps])
            lps.append([[float(d[t].logprob) for t, d in zip(c.token_ids, c.logprobs)] for c in comps])
        return SampleResponse(
            prompt_token_ids=[list(o.prompt_token_ids) for o in outs], completion_ids=ids, logprobs=lps
        )

    def load_weights(
        self, *, weights: Iterable[tuple[str, torch.Tensor]] | None = None, path: str | None = None
    ) -> float:
        """Replace the weights in place (named tensors in the checkpoint's names, or a safetensors directory), then
        drop what was computed with the old ones (encoder outputs, prefix KV). Returns the seconds it took."""
        if (weights is None) == (path is None):
            raise ValueError("load_weights takes either weights (named tensors) or path (a safetensors directory)")
        t0 = time.perf_counter()
        if weights is not None:
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": list(weights)})
            self.weights = "tensors"
        else:
            if not Path(path).is_dir() or not any(Path(path).glob("*.safetensors")):
                raise FileNotFoundError(
                    f"reload_weights: {path!r} is not a directory of *.safetensors readable by the vLLM process "
                    "(in server mode the trainer's weights_dir must be storage both machines see)"
                )
            # read here and handed over as tensors: vLLM's own ``weights_path`` also repoints the model config at the
            # folder, and the next request then looks for the processor's files there
            from safetensors.torch import load_file

            tensors = [kv for f in sorted(Path(path).glob("*.safetensors")) for kv in load_file(str(f)).items()]
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": tensors})
            self.weights = str(path)
        # stale vision-encoder outputs for an image seen before the update would otherwise be reused (and, on the
        # CPU backend, the next call with that image killed the engine)
        self.llm.llm_engine.reset_encoder_cache()
        self.llm.reset_prefix_cache()
        return time.perf_counter() - t0

    def close(self) -> None:
        llm, self.llm = self.llm, None
        if llm is not None:
            shutdown = getattr(llm.llm_engine, "shutdown", None)
            if callable(shutdown):
                shutdown()
            del llm


# -------------------------------------------------------------------------------------------------- the trainer side
def export_weights(model: torch.nn.Module, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The policy's weights under their checkpoint names, detached, cast to ``dtype`` (vLLM's) if given.

    Tied tensors are sent under every name: vLLM's CPU backend keeps a packed copy of the tied ``lm_head`` that is
    rebuilt only when ``lm_head.weight`` itself is reloaded (measured: without it the log-probs after an update of the
    embeddings were off by 0.25)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        t = t.detach()
        out[name] = t.to(dtype) if dtype is not None and t.is_floating_point() else t
    return out


def weights_fingerprint(model: torch.nn.Module) -> tuple[int, int]:
    """Changes whenever a parameter is modified in place (optimizer steps, ``load_state_dict``) or the model is
    another object: (id, sum of the parameters' version counters)."""
    return id(model), sum(p._version for p in model.parameters())


class VLLMServerClient:
    """The thin client of ``lightning_modules.engines.vllm_server``: the same ``generate`` / ``load_weights`` as
    `VLLMGenerator`, over HTTP; ``push_weights`` writes a safetensors directory under ``weights_dir`` first."""

    def __init__(self, url: str, *, timeout_s: float = 600.0) -> None:
        import httpx

        self.url = url.rstrip("/")
        self.http = httpx.Client(base_url=self.url, timeout=timeout_s)
        try:
            info = self.health()
        except httpx.HTTPError as err:
            raise ConnectionError(
                f"no vLLM server answers at {self.url} ({err}). Start one with `python -m "
                "lightning_modules.engines.vllm_server --model DIR --port P` (docs/vllm.md) and set "
                "--model.engines.rollout_args.url to it."
            ) from err
        self.model = info["model"]
        self.dtype = info["dtype"]
        self.vocab_size = info["vocab_size"]
        self.weights = info["weights"]
        self.architecture = info.get("architecture", "")
        self.takes_clips = bool(info.get("clips", False))

    def _post(self, route: str, body: BaseModel) -> dict:
        r = self.http.post(route, content=body.model_dump_json(), headers={"content-type": "application/json"})
        if r.status_code != 200:
            raise RuntimeError(f"vLLM server {self.url}{route} answered {r.status_code}: {r.text[:2000]}")
        return r.json()

    def health(self) -> dict:
        r = self.http.get("/health")
        r.raise_for_status()
        return r.json()

    def generate(self, req: SampleRequest, images: Sequence[Image.Image | VideoClip] | None = None) -> SampleResponse:
        if images is not None:
            clips = [im for im in images if isinstance(im, VideoClip)]  # a server that cannot take them says so
            stills = [im for im in images if not isinstance(im, VideoClip)]
            update = {"images": [encode_image(im) for im in stills], "videos": [encode_clip(c) for c in clips]}
            req = req.model_copy(update=update)
        return SampleResponse.model_validate(self._post("/generate", req))

    def load_weights(self, *, weights=None, path: str | None = None) -> float:
        if weights is not None or path is None:
            raise ValueError("a vLLM server reloads weights from a path it can read: use push_weights")
        t0 = time.perf_counter()
        self._post("/reload_weights", ReloadRequest(path=str(Path(path).resolve())))
        self.weights = str(path)
        return time.perf_counter() - t0

    def push_weights(self, weights: dict[str, torch.Tensor], weights_dir: str, version: int) -> float:
        """Write ``weights`` to ``weights_dir/step-<version>/model.safetensors`` (atomically: a temporary folder
        renamed), have the server reload them, then delete the older versions. Returns the seconds it took."""
        from safetensors.torch import save_file

        t0 = time.perf_counter()
        root = Path(weights_dir)
        root.mkdir(parents=True, exist_ok=True)
        final = root / f"step-{version:07d}"
        tmp = root / f".tmp-{final.name}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        storages: set[int] = set()
        tensors = {}
        for k, v in weights.items():  # safetensors refuses tensors sharing memory (tied embeddings): copy those
            ptr = v.untyped_storage().data_ptr()
            tensors[k] = v.detach().cpu().clone() if ptr in storages else v.detach().cpu().contiguous()
            storages.add(ptr)
        save_file(tensors, str(tmp / "model.safetensors"))
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        self.load_weights(path=str(final))
        for old in root.glob("step-*"):
            if old != final:
                shutil.rmtree(old, ignore_errors=True)
        return time.perf_counter() - t0

    def close(self) -> None:
        self.http.close()
