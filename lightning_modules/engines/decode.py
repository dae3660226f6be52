"""Fast GRPO rollouts for Qwen-VL (Qwen2-VL, Qwen2.5-VL, Qwen3-VL): prefill once per prompt, static KV cache,
CUDA-graph decode.

`fast_generate` is a compact generation loop of the project's own over the Hugging Face modules (the weights and the
decoder layers' sub-modules are used as they are; the loop, the KV cache and the attention calls are ours). It does
what `model.generate(do_sample=True)` does for a GRPO rollout, with three departures that change the speed and not
the result:

* **One prefill per prompt.** The B prompts (with their images) go through the vision tower and the language model
  once; the prompt's KV cache is then copied into the G rows of its group (rows ``b*G .. b*G+G-1``). `generate` on
  prompts repeated G times does the same prefill G times.
* **Static KV cache and a captured decode step.** The cache is one preallocated tensor per layer, the decode step
  (embedding, 36 decoder layers, final norm, LM head) always has the same shapes, and on CUDA it is captured once as a
  CUDA graph and replayed for every token: one launch per token instead of about a thousand.
* **No host sync per token.** Sampling (suppressed ids, min_new_tokens, temperature, top-p, then a draw) runs on the
  device; "has every row finished?" is read back every ``check_every`` steps only, for the early exit.

Positions follow Qwen2.5-VL's 3-D mRoPE exactly as transformers computes them (`get_rope_index`): text tokens advance
all three axes together, the image's tokens take (t, h, w) grid positions, and the text after the image restarts
at ``max(previous positions) + 1``. A generated token j of prompt b therefore sits at ``max_pos[b] + 1 + j`` on all
three axes (transformers: ``cache_position + rope_deltas``).

Qwen3-VL: the same loop, with the attention's per-head query / key RMSNorm (`_qkv`), the model's own interleaved
rotary embedding, and DeepStack in the prefill (the vision features of the first decoder layers' outputs are added
at the visual tokens, `qwen_vl.add_deepstack`). Decoded tokens are text, so the decode step has no DeepStack.

On a CPU (tests, the tiny config) the same loop runs eagerly, without graphs.

Sampling semantics match `generate`'s logits processors in their order: min_new_tokens (EOS masked while fewer than
``min_new_tokens`` tokens were generated), suppressed tokens (-inf), temperature, top-p (transformers' TopPLogitsWarper
rule, keeping at least one token), then a categorical draw. The draw uses the exponential-race form
(``argmax(p / E)``, ``E ~ Exp(1)``), which is the same distribution as ``torch.multinomial`` but not the same stream of
random numbers: results match `generate` in distribution, not draw for draw. ``temperature <= 0`` means greedy.
"""

from __future__ import annotations

import math
import warnings
import weakref
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from lightning_modules.models.qwen_vl import (
    ModelParts,
    add_deepstack,
    image_embeddings,
    model_parts,
    mrope_positions,
    rotate_half,
    split_visual_features,
    visual_token_id,
)

__all__ = ["fast_generate", "mrope_positions", "release_rollout_cache", "model_parts", "image_embeddings", "ModelParts"]


# --------------------------------------------------------------------------------------------------------------------
# Attention helpers over the HF decoder layer's sub-modules
# --------------------------------------------------------------------------------------------------------------------


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x [N, heads, S, D]; cos/sin [N, S, D] (model dtype, as transformers' apply_rotary_pos_emb)
    cos = cos.unsqueeze(1)
    sin = sin.unsqueeze(1)
    return x * cos + rotate_half(x) * sin


def _qkv(layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_q: int, n_kv: int, d: int):
    attn = layer.self_attn
    N, S, _ = x.shape
    q = attn.q_proj(x).view(N, S, n_q, d)
    k = attn.k_proj(x).view(N, S, n_kv, d)
    if hasattr(attn, "q_norm"):  # Qwen3-VL: RMSNorm over each head's dimensions before the rotation
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k = q.transpose(1, 2), k.transpose(1, 2)
    v = attn.v_proj(x).view(N, S, n_kv, d).transpose(1, 2)
    return _rope(q, cos, sin), _rope(k, cos, sin), v


def _finish_layer(layer, residual: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
    h = residual + layer.self_attn.o_proj(attn_out)
    return h + layer.mlp(layer.post_attention_layernorm(h))


# --------------------------------------------------------------------------------------------------------------------
# The decode engine: static buffers, optional CUDA graph, reused across calls of the same shape
# --------------------------------------------------------------------------------------------------------------------


class _DecodeEngine:
    """Static KV cache + one decode step over N rows; captured as a CUDA graph on CUDA when asked."""

    def __init__(
        self, parts: ModelParts, N: int, S: int, T: int, device, dtype, use_graph: bool, compile_step: bool = False
    ):
        tc = parts.text.config
        self.parts = parts
        self.N, self.S, self.T = N, S, T
        self.n_q = tc.num_attention_heads
        self.n_kv = tc.num_key_value_heads
        self.d = getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads
        self.scale = self.d**-0.5
        L = len(parts.text.layers)
        z = dict(device=device, dtype=dtype)
        self.k = [torch.zeros(N, self.n_kv, S, self.d, **z) for _ in range(L)]
        self.v = [torch.zeros(N, self.n_kv, S, self.d, **z) for _ in range(L)]
        self.valid = torch.zeros(N, 1, 1, S, dtype=torch.bool, device=device)  # key slots a query may see
        self.cos = torch.zeros(N, T, self.d, **z)  # rope of generated token j, all rows
        self.sin = torch.zeros(N, T, self.d, **z)
        self.tok = torch.zeros(N, dtype=torch.long, device=device)  # the token fed to the step
        self.slot = torch.zeros(1, dtype=torch.long, device=device)  # cache slot the step writes (P + j)
        self.j = torch.zeros(1, dtype=torch.long, device=device)  # index of the fed token among generated ones
        self.logits = None
        self.graph = None
        self.use_graph = use_graph
        self.compile_step = compile_step
        # torch.compile fuses the ~45 small kernels of a decoder layer (norms, rope, residuals, SiLU) into a few
        self._step_fn = torch.compile(self.step, dynamic=False) if compile_step else self.step
        self.capture_error: str | None = None
        if use_graph:
            try:
                self._capture()
            except Exception as err:  # fall back to the eager step rather than fail the rollout
                self.graph = None
                self.capture_error = f"{type(err).__name__}: {err}"
                warnings.warn(
                    f"fast_generate: CUDA graph capture failed, decoding eagerly ({self.capture_error})", stacklevel=3
                )
                torch.cuda.synchronize()

    @torch.no_grad()
    def step(self) -> torch.Tensor:
        """Feed ``tok`` at cache slot ``slot``; return next-token logits [N, V] (float32); advance slot and j."""
        p = self.parts
        N = self.N
        self.valid.index_fill_(-1, self.slot, True)
        cos = self.cos.index_select(1, self.j)  # [N, 1, D]
        sin = self.sin.index_select(1, self.j)
        h = p.text.embed_tokens(self.tok).unsqueeze(1)  # [N, 1, H]
        rep = self.n_q // self.n_kv
        for li, layer in enumerate(p.text.layers):
            q, k, v = _qkv(layer, layer.input_layernorm(h), cos, sin, self.n_q, self.n_kv, self.d)
            self.k[li].index_copy_(2, self.slot, k)
            self.v[li].index_copy_(2, self.slot, v)
            # GQA with one query position: the `rep` query heads of a KV head become `rep` query rows.
            qg = q.reshape(N, self.n_kv, rep, self.d)
            o = F.scaled_dot_product_attention(qg, self.k[li], self.v[li], attn_mask=self.valid, scale=self.scale)
            h = _finish_layer(layer, h, o.reshape(N, 1, self.n_q * self.d))
        h = p.text.norm(h[:, 0])
        logits = p.lm_head(h).float()
        self.slot.add_(1)
        self.j.add_(1)
        return logits

    def _capture(self):
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):
                self._step_fn()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            self.logits = self._step_fn()
        self.graph = g

    def run_step(self) -> torch.Tensor:
        if self.graph is not None:
            self.graph.replay()
            return self.logits
        return self._step_fn()


_ENGINES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {rows N: engine}


def release_rollout_cache(model: torch.nn.Module | None = None) -> None:
    """Free the static KV caches and CUDA graphs kept for `model` (all models when None)."""
    if model is None:
        _ENGINES.clear()
    else:
        _ENGINES.pop(model, None)


def _engine_for(model, parts, N, S_needed, T, device, dtype, use_graph, compile_step=False) -> _DecodeEngine:
    """The model's engine for ``N`` rows (kept per row count, so a validation's greedy rollout does not evict the
    training rollout's cache, graph and compiled step)."""
    engines = _ENGINES.setdefault(model, {})
    eng = engines.get(N)
    if (
        eng is not None
        and eng.S >= S_needed
        and eng.T >= T
        and eng.k[0].device == device
        and eng.k[0].dtype == dtype
        and eng.use_graph == use_graph
        and eng.compile_step == compile_step
    ):
        return eng
    engines.pop(N, None)
    eng = None
    if use_graph:
        torch.cuda.empty_cache()
    S = int(math.ceil(S_needed / 64) * 64)
    eng = _DecodeEngine(parts, N, S, T, device, dtype, use_graph, compile_step)
    engines[N] = eng
    return eng


# --------------------------------------------------------------------------------------------------------------------
# Prefill (once per prompt)
# --------------------------------------------------------------------------------------------------------------------


def _prefill(parts, eng: _DecodeEngine, embeds, positions, attention_mask, G, deepstack=(), visual_mask=None):
    """Run the B prompts through the language model, write their KV into the G rows of each group, return logits.
    ``deepstack``: per first decoder layer, the features added at ``visual_mask`` [B, P] after it (Qwen3-VL)."""
    text = parts.text
    B, P, _ = embeds.shape
    cos, sin = text.rotary_emb(embeds, positions)  # [B, P, D]
    key_ok = attention_mask.bool()
    causal = torch.ones(P, P, dtype=torch.bool, device=embeds.device).tril()
    mask = causal[None] & key_ok[:, None, :]
    mask = mask | torch.eye(P, dtype=torch.bool, device=embeds.device)[None]  # padding queries see themselves
    mask = mask[:, None]  # [B, 1, P, P]
    rep = eng.n_q // eng.n_kv
    h = embeds
    for li, layer in enumerate(text.layers):
        q, k, v = _qkv(layer, layer.input_layernorm(h), cos, sin, eng.n_q, eng.n_kv, eng.d)
        eng.k[li].view(B, G, eng.n_kv, eng.S, eng.d)[:, :, :, :P].copy_(k[:, None].expand(B, G, *k.shape[1:]))
        eng.v[li].view(B, G, eng.n_kv, eng.S, eng.d)[:, :, :, :P].copy_(v[:, None].expand(B, G, *v.shape[1:]))
        kx = k[:, :, None].expand(B, eng.n_kv, rep, P, eng.d).reshape(B, eng.n_q, P, eng.d)
        vx = v[:, :, None].expand(B, eng.n_kv, rep, P, eng.d).reshape(B, eng.n_q, P, eng.d)
        o = F.scaled_dot_product_attention(q, kx, vx, attn_mask=mask, scale=eng.scale)
        h = _finish_layer(layer, h, o.transpose(1, 2).reshape(B, P, eng.n_q * eng.d))
        if li < len(deepstack):
            h = add_deepstack(h, visual_mask, deepstack[li])
    h = text.norm(h[:, -1])
    return parts.lm_head(h).float()  # [B, V]


# --------------------------------------------------------------------------------------------------------------------
# Sampling on the device
# --------------------------------------------------------------------------------------------------------------------


def _process_and_sample(
    scores: torch.Tensor,
    n_generated: int,
    *,
    temperature: float,
    top_p: float,
    suppress: torch.Tensor | None,
    eos: torch.Tensor | None,
    min_new_tokens: int,
    generator,
) -> torch.Tensor:
    """transformers' processor order: min_new_tokens, suppress, temperature, top-p; then a categorical draw."""
    scores = scores.clone() if scores.dtype == torch.float32 else scores.float()
    if eos is not None and n_generated < min_new_tokens:
        scores.index_fill_(1, eos, -math.inf)
    if suppress is not None:
        scores.index_fill_(1, suppress, -math.inf)
    if temperature <= 0:
        return scores.argmax(-1)
    if temperature != 1.0:
        scores = scores / temperature
    if top_p < 1.0:
        sorted_logits, sorted_idx = torch.sort(scores, descending=False)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        remove_sorted = cum <= (1 - top_p)
        remove_sorted[..., -1:] = False
        remove = remove_sorted.scatter(1, sorted_idx, remove_sorted)
        scores = scores.masked_fill(remove, -math.inf)
    probs = scores.softmax(-1)
    race = torch.empty_like(probs).exponential_(generator=generator)
    return (probs / race).argmax(-1)


# --------------------------------------------------------------------------------------------------------------------
# The entry point
# --------------------------------------------------------------------------------------------------------------------


def _ids_tensor(ids: Sequence[int] | int | torch.Tensor | None, device) -> torch.Tensor | None:
    if ids is None:
        return None
    if isinstance(ids, int):
        ids = [ids]
    ids = torch.as_tensor(list(ids) if not torch.is_tensor(ids) else ids, dtype=torch.long, device=device).flatten()
    return ids if ids.numel() else None


@torch.no_grad()
def fast_generate(
    model,
    *,
    input_ids: torch.LongTensor,
    attention_mask: torch.Tensor,
    pixel_values: torch.Tensor | None,
    image_grid_thw: torch.LongTensor | None,
    group_size: int,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    suppress_token_ids: Sequence[int] = (),
    eos_token_ids: Sequence[int] = (),
    pad_token_id: int = 0,
    min_new_tokens: int = 0,
    generator: torch.Generator | None = None,
    cuda_graph: bool | None = None,
    check_every: int = 16,
    image_embeds: torch.Tensor | None = None,
    return_logprobs: bool = False,
    compile_step: bool = False,
    second_per_grid_ts: torch.Tensor | None = None,
) -> torch.LongTensor | tuple[torch.LongTensor, torch.Tensor]:
    """Sample ``group_size`` completions for each of the B prompts.

    Args:
        input_ids, attention_mask: ``[B, P]``, each prompt ONCE, left-padded (as the processor + chat template give).
        pixel_values, image_grid_thw: the B prompts' images, as the processor gives them; or their videos
            (``pixel_values_videos``, ``video_grid_thw``) when ``second_per_grid_ts`` is given.
        group_size: G; rows ``b*G .. b*G+G-1`` of the result are prompt b's completions.
        max_new_tokens / min_new_tokens: bounds on completion length (EOS is masked before ``min_new_tokens``).
        temperature / top_p: as in `generate`; ``temperature <= 0`` is greedy.
        suppress_token_ids: ids that are never sampled (image pad, vision start/end, ...).
        eos_token_ids: ids that end a completion; the EOS itself is kept, every later position is ``pad_token_id``.
        generator: a torch.Generator on the model's device, for reproducible draws.
        cuda_graph: capture the decode step as a CUDA graph (default: on when the model is on CUDA).
        check_every: read "all rows finished?" back to the host every this many tokens (early exit).
        image_embeds: precomputed vision features (skip the vision tower), from `image_embeddings` (Qwen3-VL: with
            its DeepStack features beside the merged ones).
        return_logprobs: also return each sampled token's log-prob under ``log_softmax(logits / temperature)``
            (temperature 1 when greedy; before suppression, min_new_tokens and top-p; 0 after EOS): the
            "old log-probs" of the rollout policy, as TRL computes them.
        compile_step: `torch.compile` the decode step before capturing it (CUDA graphs only; fewer, fused kernels; the first call of
            a shape pays the compilation).
        second_per_grid_ts: ``[B]`` seconds per temporal patch of each prompt's video (the processor's): the visual
            inputs are videos, their features replace ``<|video_pad|>`` tokens and temporal mRoPE spaces their t axis.

    Returns:
        ``[B*G, T_new]`` token ids, ``T_new <= max_new_tokens`` (the longest completion, like `generate`);
        with ``return_logprobs`` a pair (ids, float32 log-probs of the same shape).
    """
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    parts = model_parts(model)
    text = parts.text
    device = text.embed_tokens.weight.device
    dtype = text.embed_tokens.weight.dtype
    if getattr(text.config, "use_sliding_window", False):
        raise NotImplementedError(
            "fast_generate does not implement sliding-window attention (use_sliding_window in the "
            "model config): use --model.init_args.engines.rollout_engine hf for this model"
        )
    use_graph = (device.type == "cuda") if cuda_graph is None else (cuda_graph and device.type == "cuda")
    input_ids = input_ids.to(device)
    attention_mask = (torch.ones_like(input_ids) if attention_mask is None else attention_mask.to(device)).long()
    B, P = input_ids.shape
    G = group_size
    N = B * G
    T = max_new_tokens

    # 1) prompt embeddings with the image features scattered in (the vision tower runs once per prompt image)
    embeds = text.embed_tokens(input_ids)
    if image_embeds is None and pixel_values is not None:
        image_embeds = image_embeddings(model, pixel_values.to(device), image_grid_thw.to(device))
    img_mask = input_ids == visual_token_id(parts.config, second_per_grid_ts is not None)
    deepstack = []
    if image_embeds is not None:
        if int(img_mask.sum()) != image_embeds.shape[0]:
            raise ValueError(
                f"Image features and image tokens do not match: {int(img_mask.sum())} tokens, "
                f"{image_embeds.shape[0]} features"
            )
        merged, deepstack = split_visual_features(image_embeds, embeds.shape[-1])
        embeds = embeds.masked_scatter(img_mask[..., None], merged.to(dtype))
    positions, next_pos = mrope_positions(parts.config, input_ids, attention_mask, image_grid_thw, second_per_grid_ts)

    # 2) engine (static cache; graph captured at first use of this shape), state reset
    compile_step = compile_step and use_graph  # a CPU run (tests, the toy default) stays eager
    eng = _engine_for(model, parts, N, P + T, T, device, dtype, use_graph, compile_step)
    eng.valid.zero_()
    eng.valid[:, 0, 0, :P] = attention_mask.bool().repeat_interleave(G, dim=0)
    gen_pos = next_pos.repeat_interleave(G)[:, None] + torch.arange(T, device=device)[None]  # [N, T]
    cos, sin = text.rotary_emb(eng.cos, gen_pos[None].expand(3, N, T))
    eng.cos[:, :T].copy_(cos)
    eng.sin[:, :T].copy_(sin)
    eng.slot.fill_(P)
    eng.j.fill_(0)

    # 3) prefill (B rows) and the first token (N rows)
    prefill_logits = _prefill(parts, eng, embeds, positions, attention_mask, G, deepstack, img_mask)
    prefill_logits = prefill_logits.repeat_interleave(G, dim=0)
    eos = _ids_tensor(eos_token_ids, device)
    sample = dict(temperature=temperature, top_p=top_p, suppress=_ids_tensor(suppress_token_ids, device), eos=eos)
    sample.update(min_new_tokens=min_new_tokens, generator=generator)
    out = torch.full((N, T), pad_token_id, dtype=torch.long, device=device)
    finished = torch.zeros(N, dtype=torch.bool, device=device)
    lengths = torch.zeros(N, dtype=torch.long, device=device)  # tokens generated per row, EOS included
    pad = torch.full((N,), pad_token_id, dtype=torch.long, device=device)
    out_lp = torch.zeros((N, T), dtype=torch.float32, device=device) if return_logprobs else None
    lp_temp = temperature if temperature > 0 else 1.0

    def accept(tok: torch.Tensor, j: int, logits: torch.Tensor) -> torch.Tensor:
        nonlocal finished
        if out_lp is not None:
            lp = (logits.float() / lp_temp).log_softmax(-1).gather(1, tok[:, None])[:, 0]
            out_lp[:, j] = lp.masked_fill(finished, 0.0)
        tok = torch.where(finished, pad, tok)
        out[:, j] = tok
        lengths.add_((~finished).long())
        if eos is not None:
            finished = finished | torch.isin(tok, eos)
        return tok

    tok = accept(_process_and_sample(prefill_logits, 0, **sample), 0, prefill_logits)

    # 4) decode: token j is fed to produce token j+1
    for j in range(T - 1):
        if eos is not None and check_every and j % check_every == check_every - 1 and bool(finished.all()):
            break
        eng.tok.copy_(tok)
        logits = eng.run_step()
        tok = accept(_process_and_sample(logits, j + 1, **sample), j + 1, logits)

    t_out = max(int(lengths.max()) if N else 0, 1)
    if out_lp is not None:
        return out[:, :t_out].clone(), out_lp[:, :t_out].clone()
    return out[:, :t_out].clone()
