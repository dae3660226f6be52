"""The ``vllm`` rollout engine: completions sampled by vLLM, in the trainer process or in a vLLM server.

Two modes, as TRL offers them (docs/vllm.md):

- ``colocate``: a ``vllm.LLM`` inside the trainer process (in-process engine core, ``uni`` executor), sharing its
  device; ``gpu_memory_utilization`` or ``kv_cache_memory_bytes`` bound its memory. Weights are handed over as tensors
  (``reload_weights(weights_iterator=...)``), no disk.
- ``server``: a vLLM process (``python -m lightning_modules.engines.vllm_server --model DIR --port P``), on this node
  or a rollout node, reached by ``url``. After every optimizer step the trainer writes the policy's weights as a
  safetensors directory under ``weights_dir`` (storage the server can read) and asks the server to reload them.

What vLLM does differently from the ``hf`` / ``fast`` engines, and how the engine keeps the semantics the same:

- vLLM holds its own copy of the weights. The module calls `on_weights_updated` after every optimizer step and the
  engine pushes the weights then; in addition every `sample` compares a fingerprint of the policy's weights (the
  parameters' in-place version counters) with the one last pushed and pushes again if they differ, so a rollout never
  comes from stale weights (a resumed checkpoint, an evaluation helper that builds its own engine).
- After a push the engine checks it: vLLM samples ``sync_check_tokens`` tokens of the last prompt it saw and their
  log-probs (vLLM's raw log-probs: the full-vocabulary log-softmax at temperature 1) must match the policy's own
  forward on the same tokens within ``sync_atol`` (max over tokens); stale weights fail it.
- Special / untokenizable ids are suppressed with ``allowed_token_ids`` (every id of the model's vocabulary except
  them: masked to -inf, exactly as the other engines' suppression), EOS is masked before ``min_tokens`` tokens, top-k
  is off; greedy is temperature 0.
- vLLM resizes and tokenises each image itself; the engine checks that its prompt ids equal the processor's, which the
  update engine trains on, and fails otherwise (an image processed at another size would train on a different prompt).
- Video clips (`VideoClip`) go to vLLM as frames + their frame rate (every frame kept, the processor's pixel budget
  pinned to the frames' area as `qwen_vl.video_processor_kwargs` pins it), so its prompt ids and ``second_per_grid_ts``
  are the processor's. vLLM 0.32 puts the text after a clip at ``max(positions) + 1`` where transformers' forward
  (SFT, the update engines) puts it at ``start + max(h, w) / merge``; Qwen2.5-VL checkpoints therefore run as
  `vllm_qwen.Qwen2_5_VLWithProjectPositions` (vLLM's class with the project's positions). Other architectures keep
  refusing clips.

One vLLM per process: engines built with the same options, and engines built with no options at all (the evaluation
helpers build one from the engine's name), share the backend the first one started.
"""

from __future__ import annotations

import base64
import io
import os
import shutil
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from PIL import Image
from pydantic import BaseModel

from lightning_modules.engines.base import RolloutEngine, Sampling, register_rollout_engine
from lightning_modules.engines.fast import repeat_encoding
from lightning_modules.policy import completion_logps
from lightning_modules.qwen_vl import VideoClip, clip_pixel_budget, processor_inputs, video_processor_kwargs

__all__ = [
    "VLLMRolloutEngine",
    "VLLMGenerator",
    "VLLMServerClient",
    "SampleRequest",
    "SampleResponse",
    "EncodedClip",
    "UnsupportedClipError",
    "import_vllm",
    "export_weights",
    "weights_fingerprint",
]

VLLM_MISSING = (
    "--model.rollout_engine vllm needs the vllm package, which this Python environment ({python}) does not have. "
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
            "come from other positions than the ones the update scores. Use --model.rollout_engine fast (or hf) for "
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
                "rollout_engine_args.url to it."
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


@dataclass
class _Backend:
    """A live vLLM (colocated generator or server client) and what it knows about the weights it holds."""

    key: tuple
    impl: Any
    dtype: torch.dtype
    fingerprint: tuple[int, int] | None = None
    """`weights_fingerprint` of the policy whose weights vLLM holds (None: those of the model directory)."""
    version: int = 0
    syncs: list[dict] = field(default_factory=list)
    """Per push: seconds, and the sync check's max |log-prob difference| (``None`` when not checked)."""


_BACKENDS: dict[tuple, _Backend] = {}
"""The process's live backends by their options (in practice one: a second colocated vLLM would not fit)."""


def shutdown_backends() -> None:
    """Close every vLLM this process started (tests; a process that ends closes them anyway)."""
    while _BACKENDS:
        _, b = _BACKENDS.popitem()
        b.impl.close()


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _default_options(cls) -> dict[str, Any]:
    import inspect

    params = inspect.signature(cls.__init__).parameters
    return {k: p.default for k, p in params.items() if k not in ("self", "compile_step")}


@register_rollout_engine("vllm")
class VLLMRolloutEngine(RolloutEngine):
    """Rollouts sampled by vLLM (``--model.rollout_engine vllm``; options in ``--model.rollout_engine_args``).

    Args:
        mode: ``colocate`` (a vLLM in this process) or ``server`` (a ``vllm_server`` at ``url``).
        url: the server's address (``server``), e.g. ``http://rollout-node:8000``.
        weights_dir: (``server``) where the trainer writes each update's safetensors; must be readable by the server
            under the same path (shared storage). Default: ``<tmp>/syn-grpo-vllm-weights-<pid>`` (same machine only).
        model_path: (``colocate``) the model directory vLLM starts from; default the policy's ``name_or_path``.
            Its weights are replaced by the policy's before the first rollout.
        dtype: vLLM's dtype, ``auto``: the policy's parameter dtype.
        gpu_memory_utilization: (``colocate``, GPU) the fraction of the device vLLM may take (weights + KV cache).
        kv_cache_memory_bytes: (``colocate``) the KV cache's size in bytes instead of a fraction; on CPU 512 MiB when
            unset (vLLM's memory fraction refuses to start there).
        enforce_eager: no CUDA graphs / torch.compile in vLLM (faster start; the only mode tested here, on CPU).
        max_model_len: the longest prompt + completion vLLM accepts.
        seed: vLLM's sampling seed.
        sync_check_every: check every n-th weight push against the policy's forward (0: never).
        sync_check_tokens: tokens sampled for that check.
        sync_atol: largest allowed |log-prob(vLLM) - log-prob(policy)| over the check's tokens. The default holds for
            fp32 weights on both sides (measured on CPU: 1e-6 to 2e-5 after a sync, 0.045 to 0.63 against the weights
            of one AdamW step earlier at lr 2e-5; tests/lightning_modules/test_vllm_engine.py); bf16 needs a larger one
            (docs/vllm.md).
        timeout_s: (``server``) seconds one request may take.
    """

    def __init__(
        self,
        compile_step: bool = False,
        *,
        mode: Literal["colocate", "server"] = "colocate",
        url: str | None = None,
        weights_dir: str | None = None,
        model_path: str | None = None,
        dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto",
        gpu_memory_utilization: float = 0.3,
        kv_cache_memory_bytes: int | None = None,
        enforce_eager: bool = True,
        max_model_len: int = 4096,
        seed: int = 0,
        sync_check_every: int = 1,
        sync_check_tokens: int = 16,
        sync_atol: float = 1e-3,
        timeout_s: float = 600.0,
    ) -> None:
        super().__init__(compile_step=compile_step)
        options = {k: v for k, v in locals().items() if k not in ("self", "compile_step", "__class__")}
        if mode not in ("colocate", "server"):
            raise ValueError(f"--model.rollout_engine_args.mode must be 'colocate' or 'server', got {mode!r}")
        if mode == "server" and not url:
            raise ValueError(
                "--model.rollout_engine_args.url is required with mode: server (the address of a running "
                "`python -m lightning_modules.engines.vllm_server`), e.g. http://localhost:8000"
            )
        if dtype not in ("auto", *_DTYPES):
            raise ValueError(
                f"--model.rollout_engine_args.dtype must be auto or one of {sorted(_DTYPES)}, got {dtype!r}"
            )
        if sync_check_every < 0 or sync_check_tokens < 1 or sync_atol <= 0:
            raise ValueError(
                "--model.rollout_engine_args: sync_check_every must be >= 0, sync_check_tokens >= 1 and sync_atol > 0; "
                f"got {sync_check_every}, {sync_check_tokens}, {sync_atol}"
            )
        self.mode = mode
        self.url = url
        self.weights_dir = weights_dir
        self.model_path = model_path
        self.dtype = dtype
        self.gpu_memory_utilization = gpu_memory_utilization
        self.kv_cache_memory_bytes = kv_cache_memory_bytes
        self.enforce_eager = enforce_eager
        self.max_model_len = max_model_len
        self.seed = seed
        self.sync_check_every = sync_check_every
        self.sync_check_tokens = sync_check_tokens
        self.sync_atol = sync_atol
        self.timeout_s = timeout_s
        self._defaults_only = options == _default_options(type(self))
        """Built without options (as the evaluation helpers build one from the engine's name): shares the process's
        running vLLM whatever its options (the one started from the policy's directory, when several run)."""
        self._backend: _Backend | None = None
        self._probe: tuple[str, Image.Image | VideoClip] | None = None
        self._processor = None
        self.last_logprobs: torch.Tensor | None = None
        """vLLM's log-probs [B*G, T] of the last `sample`'s completions (raw, temperature 1; 0 on padding)."""

    def for_evaluation(self) -> VLLMRolloutEngine:
        """Evaluation generates on the same vLLM (colocated or server) as the rollouts."""
        return self

    # ------------------------------------------------------------------------------------------------ backend
    def backend(self, model) -> _Backend:
        """The vLLM this engine samples from, started (colocate) or connected (server) on first use."""
        if self._backend is not None:
            return self._backend
        if self._defaults_only and _BACKENDS:  # the vLLM started from the policy's directory, else the latest
            own = str(Path(getattr(model, "name_or_path", "") or ".").resolve())
            started_here = [b for k, b in _BACKENDS.items() if k[0] == "colocate" and k[1] == own]
            self._backend = (started_here or list(_BACKENDS.values()))[-1]
            return self._backend
        param_dtype = next(model.parameters()).dtype
        dtype = _DTYPES[self.dtype] if self.dtype != "auto" else param_dtype
        if self.mode == "server":
            key = ("server", self.url)
            if key not in _BACKENDS:
                client = VLLMServerClient(self.url, timeout_s=self.timeout_s)
                if _DTYPES.get(client.dtype) != dtype:
                    client.close()
                    raise ValueError(
                        f"the vLLM server at {self.url} runs {client.dtype}, the policy {dtype}: its samples would not "
                        f"be the policy's. Restart it with --dtype {str(dtype).removeprefix('torch.')} (or set "
                        "--model.rollout_engine_args.dtype to the server's)"
                    )
                _BACKENDS[key] = _Backend(key, client, dtype)
        else:
            path = self.model_path or getattr(model, "name_or_path", "") or ""
            if not (Path(path) / "config.json").is_file():
                raise FileNotFoundError(
                    f"the vllm rollout engine starts vLLM from a model directory, and {path!r} is none (no "
                    "config.json): set --model.rollout_engine_args.model_path to the directory the policy was "
                    "loaded from (its weights are replaced by the policy's before the first rollout)"
                )
            key = ("colocate", str(Path(path).resolve()), dtype)
            if key not in _BACKENDS:
                gen = VLLMGenerator(
                    path,
                    dtype=str(dtype).removeprefix("torch."),
                    gpu_memory_utilization=self.gpu_memory_utilization,
                    kv_cache_memory_bytes=self.kv_cache_memory_bytes,
                    enforce_eager=self.enforce_eager,
                    max_model_len=self.max_model_len,
                    seed=self.seed,
                )
                _BACKENDS[key] = _Backend(key, gen, dtype)
        self._backend = _BACKENDS[key]
        return self._backend

    def close(self) -> None:
        """Stop this engine's vLLM (colocate) or disconnect (server)."""
        if self._backend is not None:
            _BACKENDS.pop(self._backend.key, None)
            self._backend.impl.close()
            self._backend = None

    # ------------------------------------------------------------------------------------------------ weights
    def on_weights_updated(self, model) -> None:
        """After an optimizer step: push the policy's weights to vLLM (and check them)."""
        if self._backend is None:  # no vLLM yet: the first rollout starts it and pushes then
            return
        self.sync_weights(model, collective=True)

    @torch.no_grad()
    def sync_weights(self, model, *, check: bool | None = None, collective: bool = False) -> dict:
        """Push ``model``'s weights to vLLM; check them every ``sync_check_every`` pushes (or when ``check``).
        ``collective``: every trainer process calls this at the same point (server mode under DDP waits for rank 0's
        push; tests/lightning_modules/test_vllm_engine.py runs two CPU ranks)."""
        b = self.backend(model)
        weights = export_weights(model, b.dtype)
        b.version += 1
        if isinstance(b.impl, VLLMServerClient):
            # several trainer processes (DDP) hold the same weights and share one server: rank 0 writes and reloads;
            # after an optimizer step (``collective``: every rank is at the same point) the others wait for it
            dist = torch.distributed
            multi = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
            seconds = 0.0
            if not multi or dist.get_rank() == 0:
                seconds = b.impl.push_weights(weights, self._weights_dir(), b.version)
            if multi and collective:
                dist.barrier()
        else:
            seconds = b.impl.load_weights(weights=weights.items())
        b.fingerprint = weights_fingerprint(model)
        due = self.sync_check_every > 0 and b.version % self.sync_check_every == 0
        err = None
        if (due if check is None else check) and self._probe is not None:
            err = self.check_weights(model)
        record = {"version": b.version, "seconds": seconds, "max_abs_logp_diff": err}
        b.syncs.append(record)
        return record

    def _weights_dir(self) -> str:
        if self.weights_dir:
            return self.weights_dir
        import tempfile

        return str(Path(tempfile.gettempdir()) / f"syn-grpo-vllm-weights-{os.getpid()}")

    @torch.no_grad()
    def weights_logp_diff(
        self, model, processor=None, probe: tuple[str, Image.Image | VideoClip] | None = None
    ) -> float:
        """max |log-prob(vLLM) - log-prob(model)| over ``sync_check_tokens`` tokens vLLM samples for ``probe`` (default
        the last prompt it sampled), both at temperature 1 over the full vocabulary; ``model``'s in its own dtype."""
        processor = processor or self._processor
        prompt, image = probe or self._probe
        b = self.backend(model)
        req = SampleRequest(
            prompts=[prompt],
            images=[],
            n=1,
            max_tokens=self.sync_check_tokens,
            min_tokens=self.sync_check_tokens,
            suppress_ids=[],
        )
        out = b.impl.generate(req, images=[image])
        ids = torch.tensor(out.completion_ids[0][0])[None]  # [1, T]
        vllm_lp = torch.tensor(out.logprobs[0][0], dtype=torch.float64)[None]
        device = next(model.parameters()).device
        enc = processor_inputs(processor, [prompt], [image]).to(device)
        ids = ids.to(device)
        per_token = ("input_ids", "attention_mask", "mm_token_type_ids")
        inputs = {k: v for k, v in enc.items() if k not in per_token}  # pixels, grids (+ second_per_grid_ts)
        inputs["input_ids"] = torch.cat([enc["input_ids"], ids], 1)
        inputs["attention_mask"] = torch.cat([enc["attention_mask"], torch.ones_like(ids)], 1)
        if "mm_token_type_ids" in enc:
            inputs["mm_token_type_ids"] = torch.cat([enc["mm_token_type_ids"], torch.zeros_like(ids)], 1)
        was_training = model.training
        model.eval()
        try:
            logp, _ = completion_logps(model, inputs, ids)
        finally:
            model.train(was_training)
        return float((logp.double().cpu() - vllm_lp).abs().max())

    def check_weights(self, model) -> float:
        """`weights_logp_diff`, failing when it exceeds ``sync_atol`` (vLLM would sample from other weights)."""
        err = self.weights_logp_diff(model)
        if not err <= self.sync_atol:
            raise RuntimeError(
                f"vLLM's weights do not match the policy's after the weight sync: max |log-prob difference| {err:.3g} "
                f"over {self.sync_check_tokens} sampled tokens > sync_atol={self.sync_atol:g} ({self.mode} mode, "
                f"weights from {self._backend.impl.weights}). Rolling out from them would train on stale samples. "
                "Check that the server reads the trainer's weights_dir, that the dtypes agree, or raise "
                "--model.rollout_engine_args.sync_atol for low-precision weights (docs/vllm.md)."
            )
        return err

    # ------------------------------------------------------------------------------------------------ sampling
    def sample(self, model, processor, prompts, images, *, group_size, sampling: Sampling, suppress_ids, eos_ids):
        b = self.backend(model)
        if any(isinstance(im, VideoClip) for im in images) and not b.impl.takes_clips:
            raise UnsupportedClipError(b.impl.architecture or "an unknown architecture")
        self._processor = processor
        self._probe = (prompts[0], images[0])
        if b.fingerprint != weights_fingerprint(model):
            # the policy's weights are not the ones vLLM holds (first rollout, resumed checkpoint, a step whose
            # module did not call on_weights_updated): push them before sampling
            self.sync_weights(model)
        req = SampleRequest(
            prompts=list(prompts),
            images=[],
            n=group_size,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            max_tokens=sampling.max_new_tokens,
            min_tokens=sampling.min_new_tokens,
            greedy=sampling.greedy,
            stop_token_ids=list(eos_ids),
            suppress_ids=list(suppress_ids),
        )
        out = b.impl.generate(req, images=images)
        enc = processor_inputs(processor, list(prompts), list(images))
        for i, got in enumerate(out.prompt_token_ids):
            want = enc["input_ids"][i][enc["attention_mask"][i].bool()].tolist()
            if got != want:
                raise RuntimeError(
                    f"vLLM tokenised prompt {i} into {len(got)} ids, the processor into {len(want)}: the update would "
                    "train on another prompt than the one sampled from (most often the image or clip resized "
                    "differently: vLLM reads the processor's settings from the model directory it started from, "
                    f"{b.impl.model!r}, so they must be the policy processor's)"
                )
        rows = [c for per_prompt in out.completion_ids for c in per_prompt]
        row_lps = [lp for per_prompt in out.logprobs for lp in per_prompt]
        T = max(1, max(len(c) for c in rows))
        pad = processor.tokenizer.pad_token_id
        completion_ids = torch.full((len(rows), T), pad, dtype=torch.long)
        logps = torch.zeros((len(rows), T), dtype=torch.float32)
        for i, (c, lp) in enumerate(zip(rows, row_lps)):
            completion_ids[i, : len(c)] = torch.tensor(c, dtype=torch.long)
            logps[i, : len(lp)] = torch.tensor(lp, dtype=torch.float32)
        self.last_logprobs = logps
        device = next(model.parameters()).device
        enc = {k: v.to(device) for k, v in repeat_encoding(enc, group_size).items()}
        return completion_ids.to(device), enc
