"""Efficient GRPO policy updates for Qwen-VL (Qwen2-VL, Qwen2.5-VL, Qwen3-VL with DeepStack): score completions
without the per-sample multimodal overhead.

What the stock path (``model(**inputs)`` on B*G rows, then log-softmax) spends its time on, and what this does instead:

* **The vision tower runs once per unique image.** The G completions of a prompt share its image, so the merged
  vision features are computed for the B prompts and gathered into the B*G rows (exact: the same features; under
  autograd the gather sums the G rows' gradients, which is what G separate towers would sum in the weights).
  With several micro-batches the tower's backward runs once, after the last micro-batch (`policy_backward`).
* **The vision tower's window attention is batched** (`enable_fast_vision_attention`): transformers' sdpa path
  loops over windows in Python (16 windows x 120 images x 28 layers = ~54k attention calls per forward); with equal
  window sizes it is one attention call per layer. Same math, same kernels' numerics per window.
* **Right padding, causal attention, no mask.** Each row is laid out as [prompt (its left padding dropped),
  completion up to EOS, padding on the right]; with padding only on the right, plain causal attention is exact for
  every real token, so SDPA takes its flash path (no mask tensor, no padding queries attending anywhere).
* **Length-bucketed micro-batches.** Rows are sorted by length and each micro-batch is cut to its own longest row.
* **Chunked log-softmax from hidden states.** Only completion positions go through the LM head, in chunks, and
  under autograd each chunk is recomputed in backward: no [rows, T, vocab] float32 logits ever exist.
* **mRoPE positions as in generation.** The prompt keeps the 3-D positions of `get_rope_index`; completion token t
  of prompt b is at ``max_pos[b] + 1 + t`` on all axes, which is what `generate` and `fast_generate` used.

The reference model can reuse the policy's image features (``image_embeds=``) only when both vision towers hold the
same weights (a frozen tower, or the first step); with a trained tower, run it per model.
"""

from __future__ import annotations

import math
import types
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from lightning_modules.models.qwen_vl import (
    add_deepstack,
    image_embeddings,
    model_parts,
    mrope_positions,
    rotate_half,
    split_visual_features,
    visual_token_id,
)

__all__ = [
    "PackedRollout",
    "pack_rollout",
    "completion_logprobs",
    "policy_backward",
    "enable_fast_vision_attention",
    "image_embeddings",
    "micro_batches",
]


# --------------------------------------------------------------------------------------------------------------------
# Vision tower: one attention call per layer instead of one per window
# --------------------------------------------------------------------------------------------------------------------


def _chunk_lengths(cu_seqlens: torch.Tensor) -> list[int]:
    cached = getattr(cu_seqlens, "_syn_grpo_lengths", None)
    if cached is None:
        cached = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
        try:
            cu_seqlens._syn_grpo_lengths = cached  # the same tensor serves every layer of its kind in one forward
        except (AttributeError, RuntimeError):
            pass
    return cached


def _batched_vision_attention(self, hidden_states, cu_seqlens, position_embeddings=None, max_seqlen=None, **kwargs):
    """Drop-in for Qwen2_5_VLVisionAttention.forward (sdpa): all windows / images in one SDPA call."""
    S = hidden_states.shape[0]
    H = self.num_heads
    q, k, v = self.qkv(hidden_states).reshape(S, 3, H, -1).permute(1, 0, 2, 3).unbind(0)  # [S, H, D]
    cos, sin = position_embeddings
    dt = q.dtype
    cos, sin = cos.unsqueeze(-2).float(), sin.unsqueeze(-2).float()
    qf, kf = q.float(), k.float()
    q = (qf * cos + rotate_half(qf) * sin).to(dt)
    k = (kf * cos + rotate_half(kf) * sin).to(dt)
    D = q.shape[-1]
    lengths = _chunk_lengths(cu_seqlens)
    n = len(lengths)
    L = max(lengths)
    if all(x == L for x in lengths):
        qb, kb, vb = (t.reshape(n, L, H, D).transpose(1, 2) for t in (q, k, v))
        o = F.scaled_dot_product_attention(qb, kb, vb, scale=self.scaling)
        o = o.transpose(1, 2).reshape(S, H * D)
    else:  # unequal windows (images whose grid is not a multiple of the window): pad each to the longest, mask keys
        dev = q.device
        lens = torch.tensor(lengths, device=dev)
        starts = cu_seqlens[:-1].to(dev).long()
        ar = torch.arange(L, device=dev)
        valid = ar[None] < lens[:, None]  # [n, L]
        idx = torch.where(valid, starts[:, None] + ar[None], torch.zeros_like(ar)[None])
        qb, kb, vb = (t[idx].transpose(1, 2) for t in (q, k, v))  # [n, H, L, D]
        o = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=valid[:, None, None, :], scale=self.scaling)
        o = o.transpose(1, 2)[valid].reshape(S, H * D)
    return self.proj(o)


def enable_fast_vision_attention(model) -> int:
    """Replace the vision tower's per-window attention loop by one batched SDPA call per layer (exact; idempotent).

    Only for the sdpa / eager attention implementations (flash-attention-2 already runs variable-length windows in
    one call). Returns the number of attention modules patched.
    """
    visual = model_parts(model).visual
    impl = getattr(visual.config, "_attn_implementation", "sdpa")
    if impl not in ("sdpa", "eager", None):
        return 0
    n = 0
    for blk in visual.blocks:
        attn = blk.attn
        if getattr(attn, "_syn_grpo_fast", False):
            continue
        attn.forward = types.MethodType(_batched_vision_attention, attn)
        attn._syn_grpo_fast = True
        n += 1
    return n


# --------------------------------------------------------------------------------------------------------------------
# Packing a rollout for teacher-forced scoring
# --------------------------------------------------------------------------------------------------------------------


@dataclass
class PackedRollout:
    """B prompts x G completions laid out right-padded for scoring; rows grouped by prompt (row n is prompt n // G).

    Shapes: ``input_ids`` [N, L] (prompt without its left padding, then the completion up to EOS, then pad),
    ``positions`` [3, N, L], ``lengths`` [N] real tokens per row, ``comp_start`` [N] index of the first completion
    token, ``completion_ids`` / ``completion_mask`` [N, T], ``feat_offsets`` [B + 1] each prompt's slice of the flat
    image features, ``pixel_values`` / ``image_grid_thw`` for the B prompts only.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    lengths: torch.Tensor
    comp_start: torch.Tensor
    completion_ids: torch.Tensor
    completion_mask: torch.Tensor
    feat_offsets: torch.Tensor
    pixel_values: torch.Tensor | None
    image_grid_thw: torch.Tensor | None
    group_size: int
    image_token_id: int
    """The placeholder the vision features replace (``<|video_pad|>``'s id for a video rollout)."""

    @property
    def num_tokens(self) -> int:
        """Real tokens scored (prompt + completion up to EOS, summed over rows)."""
        return int(self.lengths.sum())


def _dedupe_groups(prompt_ids, prompt_mask, pixel_values, image_grid_thw, G, n_rows, second_per_grid_ts=None):
    """Accept prompts given once [B, P] or repeated per completion [B*G, P] (rows grouped); return the B-prompt form."""
    if prompt_ids.shape[0] == n_rows and G > 1:
        keep = torch.arange(0, n_rows, G, device=prompt_ids.device)
        if second_per_grid_ts is not None:
            second_per_grid_ts = second_per_grid_ts[keep.to(second_per_grid_ts.device)]
        if pixel_values is not None:
            counts = image_grid_thw.prod(-1)
            # every row of a group holds its prompt's images; all rows hold the same number of images
            offs = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
            imgs_per_row = image_grid_thw.shape[0] // n_rows
            rows_pix = []
            for r in keep.tolist():
                a, b = int(offs[r * imgs_per_row]), int(offs[(r + 1) * imgs_per_row])
                rows_pix.append(pixel_values[a:b])
            pixel_values = torch.cat(rows_pix)
            image_grid_thw = image_grid_thw.view(n_rows, imgs_per_row, 3)[keep].reshape(-1, 3)
        return prompt_ids[keep], prompt_mask[keep], pixel_values, image_grid_thw, second_per_grid_ts
    if prompt_ids.shape[0] * G != n_rows:
        raise ValueError(f"{prompt_ids.shape[0]} prompts and {n_rows} completions do not fit group_size={G}")
    return prompt_ids, prompt_mask, pixel_values, image_grid_thw, second_per_grid_ts


def pack_rollout(
    model_or_config,
    *,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    pixel_values: torch.Tensor | None,
    image_grid_thw: torch.Tensor | None,
    group_size: int,
    pad_token_id: int = 0,
    second_per_grid_ts: torch.Tensor | None = None,
) -> PackedRollout:
    """Lay a rollout out for `completion_logprobs` / `policy_backward` (CPU or GPU; a few small host syncs).

    ``prompt_ids`` / ``prompt_mask`` / ``pixel_values`` / ``image_grid_thw`` may hold the B prompts once or repeated
    G times (rows grouped, as `Rollout` stores them); ``completion_mask`` is 1 up to and including EOS. With
    ``second_per_grid_ts`` (one per prompt or per row) the visual inputs are videos (``pixel_values_videos``,
    ``video_grid_thw``): their features replace ``<|video_pad|>`` tokens, with temporal mRoPE positions.
    """
    config = model_or_config.config if hasattr(model_or_config, "config") else model_or_config
    G = group_size
    N, T = completion_ids.shape
    prompt_ids, prompt_mask, pixel_values, image_grid_thw, second_per_grid_ts = _dedupe_groups(
        prompt_ids, prompt_mask, pixel_values, image_grid_thw, G, N, second_per_grid_ts
    )
    device = completion_ids.device
    prompt_ids, prompt_mask = prompt_ids.to(device), prompt_mask.to(device)
    pos, next_pos = mrope_positions(config, prompt_ids, prompt_mask, image_grid_thw, second_per_grid_ts)
    token_id = visual_token_id(config, second_per_grid_ts is not None)
    p_len = prompt_mask.long().sum(-1)  # [B]
    c_len = completion_mask.long().sum(-1)  # [N]
    row_b = torch.arange(N, device=device) // G
    lengths = p_len[row_b] + c_len
    L = int(lengths.max())
    ids = torch.full((N, L), pad_token_id, dtype=torch.long, device=device)
    positions = torch.zeros(3, N, L, dtype=torch.long, device=device)
    # prompt part: the real tokens of prompt b, left-aligned (vectorised with a per-row column shift)
    P = prompt_ids.shape[1]
    shift = (P - p_len)[row_b]  # left padding of the row's prompt
    col = torch.arange(L, device=device)[None]  # [1, L]
    src = col + shift[:, None]  # column in the padded prompt
    in_prompt = col < p_len[row_b][:, None]
    src_c = src.clamp(max=P - 1)
    ids = torch.where(in_prompt, prompt_ids[row_b][torch.arange(N, device=device)[:, None], src_c], ids)
    ppos = pos[:, row_b]  # [3, N, P]
    gathered = ppos.gather(2, src_c[None].expand(3, N, L))
    positions = torch.where(in_prompt[None], gathered, positions)
    # completion part
    t_idx = col - p_len[row_b][:, None]  # completion index at each column
    in_comp = (t_idx >= 0) & (t_idx < c_len[:, None])
    t_c = t_idx.clamp(0, T - 1)
    ids = torch.where(in_comp, completion_ids.gather(1, t_c), ids)
    cpos = next_pos[row_b][:, None] + t_idx
    positions = torch.where(in_comp[None], cpos[None].expand(3, N, L), positions)
    n_img = (prompt_ids == token_id).long().sum(-1)  # [B]
    feat_offsets = torch.cat([n_img.new_zeros(1), n_img.cumsum(0)])
    return PackedRollout(
        input_ids=ids,
        positions=positions,
        lengths=lengths,
        comp_start=p_len[row_b],
        completion_ids=completion_ids,
        completion_mask=completion_mask.bool(),
        feat_offsets=feat_offsets,
        pixel_values=pixel_values,
        image_grid_thw=image_grid_thw,
        group_size=G,
        image_token_id=token_id,
    )


def micro_batches(
    packed: PackedRollout, micro_batch_size: int = 8, max_tokens: int | None = None
) -> list[torch.Tensor]:
    """Row indices of length-bucketed micro-batches: rows sorted by length (longest first), at most
    ``micro_batch_size`` rows and (if given) ``max_tokens`` padded tokens each."""
    order = torch.argsort(packed.lengths.cpu(), descending=True, stable=True)
    lens = packed.lengths.cpu()[order].tolist()
    out, cur, cur_max = [], [], 0
    for i, ln in zip(order.tolist(), lens):
        new_max = max(cur_max, ln)
        if cur and (len(cur) >= micro_batch_size or (max_tokens and new_max * (len(cur) + 1) > max_tokens)):
            out.append(torch.tensor(cur))
            cur, new_max = [], ln
        cur.append(i)
        cur_max = new_max
    if cur:
        out.append(torch.tensor(cur))
    return out


# --------------------------------------------------------------------------------------------------------------------
# Scoring
# --------------------------------------------------------------------------------------------------------------------


def _head_chunk(h: torch.Tensor, weight: torch.Tensor, bias, targets: torch.Tensor, inv_temp: float, want_ent: bool):
    logits = F.linear(h, weight, bias).float()
    if inv_temp != 1.0:
        logits = logits * inv_temp
    lse = torch.logsumexp(logits, dim=-1)
    logp = logits.gather(-1, targets[:, None])[:, 0] - lse
    if not want_ent:
        return logp, None
    ent = lse - (logits.softmax(-1) * logits).sum(-1)
    return logp, ent


def _head_logprobs(lm_head, hid, targets, temperature, with_entropy, grad, chunk_tokens, entropy_grad=False):
    """Per-token log-probs (and entropies) of ``targets`` [n, T] from hidden states [n, T, H], in chunks."""
    n, T, Hd = hid.shape
    flat, tgt = hid.reshape(n * T, Hd), targets.reshape(n * T)
    inv_temp = 1.0 / temperature if temperature > 0 else 1.0
    lps, ents = [], []
    for s in range(0, n * T, chunk_tokens):
        h = flat[s : s + chunk_tokens]
        t = tgt[s : s + chunk_tokens]
        if grad and torch.is_grad_enabled():
            lp, ent = checkpoint(
                _head_chunk, h, lm_head.weight, lm_head.bias, t, inv_temp, with_entropy, use_reentrant=False
            )
        else:
            lp, ent = _head_chunk(h, lm_head.weight, lm_head.bias, t, inv_temp, with_entropy)
        lps.append(lp)
        if with_entropy:
            ents.append(ent if entropy_grad else ent.detach())
    logp = torch.cat(lps).view(n, T)
    ent = torch.cat(ents).view(n, T) if with_entropy else None
    return logp, ent


def _feature_index(packed: PackedRollout, rows: torch.Tensor) -> torch.Tensor:
    """Flat indices into the B prompts' image features, for the image tokens of ``rows`` in order."""
    b = rows // packed.group_size
    off = packed.feat_offsets.to(rows.device)
    start, count = off[b], off[b + 1] - off[b]
    total = int(count.sum())
    base = torch.repeat_interleave(start - (count.cumsum(0) - count), count, output_size=total)
    return base + torch.arange(total, device=rows.device)


def _embed(text, ids: torch.Tensor, feats, feat_index: Callable[[], torch.Tensor] | None, image_token_id: int):
    """Token embeddings with the image features scattered into the image tokens: (h, image-token mask or None,
    DeepStack features). ``feat_index()``: the flat indices of the features, in the order the image tokens appear."""
    h = text.embed_tokens(ids)
    if feats is None:
        return h, None, []
    img = ids == image_token_id
    f = feats.index_select(0, feat_index().to(feats.device))
    merged, deepstack = split_visual_features(f, h.shape[-1])  # Qwen3-VL: DeepStack features beside the merged
    return h.masked_scatter(img[..., None], merged.to(h.dtype)), img, deepstack


def _decode(text, h, mask, pos, img, deepstack, *, grad: bool, checkpoint_layers: bool) -> torch.Tensor:
    """The decoder layers (checkpointed when asked and the layer does not checkpoint itself) and the final norm."""
    cos, sin = text.rotary_emb(h, pos)
    for li, layer in enumerate(text.layers):
        hf_ckpt = getattr(layer, "gradient_checkpointing", False) and layer.training
        if grad and checkpoint_layers and not hf_ckpt and torch.is_grad_enabled():
            h = checkpoint(_call_layer, layer, h, mask, cos, sin, use_reentrant=False)
        else:
            h = _call_layer(layer, h, mask, cos, sin)
        if li < len(deepstack):
            h = add_deepstack(h, img, deepstack[li])
    return text.norm(h)


def _completion_scores(
    parts, packed: PackedRollout, hid, rows, *, temperature, with_entropy, grad, chunk_tokens, entropy_grad
):
    """Log-probs (and entropies) [n, T] of ``rows``' completion tokens from the hidden states predicting them
    (``hid`` [n, T, H]), 0 outside ``completion_mask``."""
    device = hid.device
    targets = packed.completion_ids.to(device)[rows]
    logp, ent = _head_logprobs(
        parts.lm_head, hid, targets, temperature, with_entropy, grad, chunk_tokens, entropy_grad=entropy_grad
    )
    cmask = packed.completion_mask.to(device)[rows]
    logp = logp.masked_fill(~cmask, 0.0)
    if ent is not None:
        ent = ent.masked_fill(~cmask, 0.0)
    return logp, ent


def _forward_rows(
    model,
    packed: PackedRollout,
    rows,
    feats,
    *,
    temperature,
    with_entropy,
    grad,
    checkpoint_layers,
    chunk_tokens,
    entropy_grad=False,
):
    parts = model_parts(model)
    text = parts.text
    device = text.embed_tokens.weight.device
    rows = rows.to(device)
    L = int(packed.lengths[rows].max())
    ids = packed.input_ids.to(device)[rows, :L]
    pos = packed.positions.to(device)[:, rows, :L]
    index = None if feats is None else (lambda: _feature_index(packed, rows.to(feats.device)))
    h, img, deepstack = _embed(text, ids, feats, index, packed.image_token_id)
    impl = getattr(text.config, "_attn_implementation", "sdpa")
    mask = None
    if impl not in ("sdpa", "flash_attention_2", "flash_attention_3", "flex_attention"):  # eager needs a causal mask
        mask = torch.full((L, L), -math.inf, device=device, dtype=h.dtype).triu(1)[None, None]
    h = _decode(text, h, mask, pos, img, deepstack, grad=grad, checkpoint_layers=checkpoint_layers)
    # hidden state at column comp_start + t - 1 predicts completion token t
    T = packed.completion_ids.shape[1]
    start = packed.comp_start.to(device)[rows]
    col = (start[:, None] - 1 + torch.arange(T, device=device)[None]).clamp(max=L - 1)
    hid = h.gather(1, col[..., None].expand(-1, -1, h.shape[-1]))
    return _completion_scores(
        parts,
        packed,
        hid,
        rows,
        temperature=temperature,
        with_entropy=with_entropy,
        grad=grad,
        chunk_tokens=chunk_tokens,
        entropy_grad=entropy_grad,
    )


def _call_layer(layer, h, mask, cos, sin):
    out = layer(h, attention_mask=mask, position_embeddings=(cos, sin))
    return out[0] if isinstance(out, tuple) else out


class RowLayout:
    """The default layout: each completion a right-padded row [prompt | completion], length-bucketed micro-batches."""

    @staticmethod
    def batches(packed: PackedRollout, micro_batch_size: int, max_tokens: int | None) -> list[torch.Tensor]:
        return micro_batches(packed, micro_batch_size, max_tokens)

    @staticmethod
    def forward(model, packed: PackedRollout, rows: torch.Tensor, feats, **fwd):
        lp, e = _forward_rows(model, packed, rows, feats, **fwd)
        return rows, lp, e


ROWS = RowLayout()


def _over_micro_batches(
    model, packed, feats, dev, *, micro_batch_size, max_tokens, with_entropy, fwd, step=None, layout=None
):
    """``layout.forward`` (`_forward_rows` by default) over every micro-batch of ``layout.batches`` (``fwd``: its
    keyword arguments); ``step(rows, logp, entropy)`` uses each micro-batch's outputs (the policy's loss and backward);
    returns the detached float32 log-probs [N, T] and entropies [N, T] (or None) of all rows."""
    layout = layout or ROWS
    N, T = packed.completion_ids.shape
    logp = torch.zeros(N, T, dtype=torch.float32, device=dev)
    ent = torch.zeros(N, T, dtype=torch.float32, device=dev) if with_entropy else None
    for batch in layout.batches(packed, micro_batch_size, max_tokens):
        rows, lp, e = layout.forward(model, packed, batch, feats, with_entropy=with_entropy, **fwd)
        if step is not None:
            step(rows.to(dev), lp, e)
        logp[rows.to(dev)] = lp.detach()
        if with_entropy:
            ent[rows.to(dev)] = e.detach()
    return logp, ent


@torch.no_grad()
def completion_logprobs(
    model,
    packed: PackedRollout,
    *,
    micro_batch_size: int = 16,
    max_tokens: int | None = None,
    temperature: float = 1.0,
    with_entropy: bool = False,
    image_embeds: torch.Tensor | None = None,
    chunk_tokens: int = 4096,
    layout=None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probs [N, T] (float32, 0 outside ``completion_mask``) of the completions under ``model``, no grad.

    For reference log-probs and old log-probs (``num_iterations > 1``). ``image_embeds``: the B prompts' merged vision
    features from `image_embeddings` when already computed with the same vision weights. ``layout``: how rows are
    laid out (`RowLayout` by default; ``shared_prompt.SHARED_PROMPT``: each prompt once per group).
    """
    if image_embeds is None and packed.pixel_values is not None:
        dev = model_parts(model).text.embed_tokens.weight.device
        image_embeds = image_embeddings(model, packed.pixel_values.to(dev), packed.image_grid_thw.to(dev))
    dev = model_parts(model).text.embed_tokens.weight.device
    return _over_micro_batches(
        model,
        packed,
        image_embeds,
        dev,
        micro_batch_size=micro_batch_size,
        max_tokens=max_tokens,
        with_entropy=with_entropy,
        fwd=dict(temperature=temperature, grad=False, checkpoint_layers=False, chunk_tokens=chunk_tokens),
        layout=layout,
    )


LossFn = Callable[[torch.Tensor, "torch.Tensor | None", torch.Tensor], torch.Tensor]


def policy_backward(
    model,
    packed: PackedRollout,
    loss_fn: LossFn,
    *,
    micro_batch_size: int = 8,
    max_tokens: int | None = None,
    temperature: float = 1.0,
    with_entropy: bool = False,
    gradient_checkpointing: bool = False,
    vision_checkpointing: bool = False,
    entropy_grad: bool = False,
    backward: Callable[[torch.Tensor], None] | None = None,
    chunk_tokens: int = 4096,
    layout=None,
) -> dict[str, torch.Tensor]:
    """Forward + backward of the policy over all rows in length-bucketed micro-batches; gradients accumulate.

    ``loss_fn(logp [n, T], entropy [n, T] | None, rows [n]) -> scalar``: the micro-batch's share of the total loss
    (slice advantages / old / reference log-probs / masks with ``rows``; normalise by the WHOLE batch's token count
    for a token-mean, so that the accumulated gradient is the full-batch gradient). ``backward``: e.g. Lightning's
    ``self.manual_backward`` (default ``loss.backward()``). The vision tower runs forward once for the B prompts and
    backward once after the last micro-batch. The optimizer step is the caller's. ``entropy_grad``: the entropy given
    to ``loss_fn`` carries gradient (the "GRPO + entropy loss" baseline); otherwise it is detached.
    ``vision_checkpointing``: keep only the vision tower's inputs and recompute its forward in the deferred backward
    (one extra vision forward; frees its activations across all micro-batches). ``layout``: as `completion_logprobs`.

    Returns detached ``logp`` [N, T], ``entropy`` [N, T] (if asked) and the summed ``loss``.
    """
    backward = backward or (lambda loss: loss.backward())
    parts = model_parts(model)
    dev = parts.text.embed_tokens.weight.device
    feats = feats_leaf = None
    if packed.pixel_values is not None:
        pix, grid = packed.pixel_values.to(dev), packed.image_grid_thw.to(dev)
        if vision_checkpointing and torch.is_grad_enabled():
            # keep only the vision tower's inputs: its activations (20 images x 1024 patches x 32 blocks for the 3B,
            # ~30 GB) would live from this forward to the deferred backward; recomputing costs one vision forward
            feats = checkpoint(image_embeddings, model, pix, grid, use_reentrant=False)
        else:
            feats = image_embeddings(model, pix, grid)
        feats_leaf = feats.detach().requires_grad_(feats.requires_grad)
    total = torch.zeros((), dtype=torch.float32, device=dev)
    fwd = dict(temperature=temperature, grad=True, checkpoint_layers=gradient_checkpointing, chunk_tokens=chunk_tokens)
    fwd["entropy_grad"] = entropy_grad

    def step(rows, lp, e):
        nonlocal total
        loss = loss_fn(lp, e, rows)
        backward(loss)
        total += loss.detach()

    logp_all, ent_all = _over_micro_batches(
        model,
        packed,
        feats_leaf,
        dev,
        micro_batch_size=micro_batch_size,
        max_tokens=max_tokens,
        with_entropy=with_entropy,
        step=step,
        fwd=fwd,
        layout=layout,
    )
    if feats is not None and feats.requires_grad and feats_leaf.grad is not None:
        torch.autograd.backward(feats, feats_leaf.grad)  # the vision tower's backward, once for all micro-batches
    out = {"logp": logp_all, "loss": total}
    if with_entropy:
        out["entropy"] = ent_all
    return out


def count_parameters(module: torch.nn.Module | None) -> int:
    return 0 if module is None else sum(p.numel() for p in module.parameters())


def model_flops_per_token(model) -> dict[str, float]:
    """Matmul parameters touched per token, for MFU: decoder layers (every token), LM head (scored tokens),
    vision tower (per patch, excluding the patch merger which runs per merged token)."""
    parts = model_parts(model)
    layers = sum(
        p.numel()
        for layer in parts.text.layers
        for n, p in layer.named_parameters()
        if n.endswith("weight") and p.dim() == 2
    )
    head = parts.lm_head.weight.numel()
    blocks = sum(p.numel() for blk in parts.visual.blocks for n, p in blk.named_parameters() if p.dim() == 2)
    mergers = [parts.visual.merger, *getattr(parts.visual, "deepstack_merger_list", [])]
    merger = sum(p.numel() for m in mergers for p in m.parameters() if p.dim() == 2)
    patch = parts.visual.patch_embed.proj.weight.numel()
    return {
        "decoder": float(layers),
        "lm_head": float(head),
        "vision_blocks": float(blocks + patch),
        "vision_merger": float(merger),
    }
