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

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from PIL import Image

from core.video import VideoClip
from lightning_modules.engines.base import RolloutEngine, Sampling
from lightning_modules.engines.fast import repeat_encoding
from lightning_modules.engines.hf import completion_logps
from lightning_modules.engines.vllm_backend import (
    SampleRequest,
    UnsupportedClipError,
    VLLMGenerator,
    VLLMServerClient,
    export_weights,
    weights_fingerprint,
)
from lightning_modules.models.qwen_vl import processor_inputs

__all__ = ["VLLMRolloutEngine", "shutdown_backends"]


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


class VLLMRolloutEngine(RolloutEngine):
    """Rollouts sampled by vLLM (``--model.engines.rollout_engine vllm``; options in ``--model.engines.rollout_args``).

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
            raise ValueError(f"--model.engines.rollout_args.mode must be 'colocate' or 'server', got {mode!r}")
        if mode == "server" and not url:
            raise ValueError(
                "--model.engines.rollout_args.url is required with mode: server (the address of a running "
                "`python -m lightning_modules.engines.vllm_server`), e.g. http://localhost:8000"
            )
        if dtype not in ("auto", *_DTYPES):
            raise ValueError(
                f"--model.engines.rollout_args.dtype must be auto or one of {sorted(_DTYPES)}, got {dtype!r}"
            )
        if sync_check_every < 0 or sync_check_tokens < 1 or sync_atol <= 0:
            raise ValueError(
                "--model.engines.rollout_args: sync_check_every must be >= 0, sync_check_tokens >= 1 and sync_atol > 0; "
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
                        "--model.engines.rollout_args.dtype to the server's)"
                    )
                _BACKENDS[key] = _Backend(key, client, dtype)
        else:
            path = self.model_path or getattr(model, "name_or_path", "") or ""
            if not (Path(path) / "config.json").is_file():
                raise FileNotFoundError(
                    f"the vllm rollout engine starts vLLM from a model directory, and {path!r} is none (no "
                    "config.json): set --model.engines.rollout_args.model_path to the directory the policy was "
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
                "--model.engines.rollout_args.sync_atol for low-precision weights (docs/vllm.md)."
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
