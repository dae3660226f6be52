"""The ``packed_shared`` update engine: the ``packed`` engine with each prompt scored once per group.

The G completions of a prompt share every prompt token (the image's 256 tokens and the text): in the ``packed`` layout
each of the G rows runs the decoder over the whole prompt again (REC on the 3B: ~400 prompt and 256 completion tokens
per row, so 61 % of the tokens a step scores are prompt copies). Here a group is one sequence::

    [prompt | completion 1 | completion 2 | ... | completion G]

with a mask under which a prompt token attends to the prompt before it (causal) and completion i's tokens attend to
the whole prompt and to completion i up to themselves; positions are those of the ``packed`` layout (completion token
t of prompt b at ``max_pos[b] + 1 + t``). Each completion token therefore sees exactly the keys and values it sees in
its own row, so the log-probs are the same function of the weights; under autograd the prompt's activations receive
the G completions' gradients summed, which is what G copies would add into the weights. The decoder runs over
``P + sum(c_i)`` tokens per group instead of ``G * P + sum(c_i)`` (the 3B's REC step: ~2.0x fewer).

The mask is dense per group (``[groups, 1, L, L]``, L = one group's tokens): SDPA runs it with its masked kernel (the
attention of a group of ~1.9k tokens is a few percent of the layer's matmuls). Micro-batches hold whole groups, as many
as fit the token budget the ``packed`` engine's micro-batch would use (``micro_batch_size`` rows of the longest row's
length, or ``max_tokens``); groups are sorted by length and right-padded to the longest in their micro-batch.
Attention implementations: ``sdpa`` and ``eager`` (a flash-attention implementation takes no such mask).
"""

from __future__ import annotations

import math

import torch

from lightning_modules.engines.packed import PackedUpdateEngine
from lightning_modules.engines.packing import PackedRollout, _completion_scores, _decode, _embed
from lightning_modules.models.qwen_vl import model_parts

__all__ = ["SHARED_PROMPT", "SharedPromptLayout", "SharedPromptUpdateEngine", "group_micro_batches"]

MASKED_IMPLEMENTATIONS = ("sdpa", "eager")


def group_micro_batches(
    packed: PackedRollout, micro_batch_size: int = 8, max_tokens: int | None = None
) -> list[list[int]]:
    """Prompt indices per micro-batch: groups sorted by their token count (longest first), each micro-batch within the
    token budget (``max_tokens``, else ``micro_batch_size`` x the longest row) counted as groups x its longest group."""
    G = packed.group_size
    lengths = packed.lengths.cpu().view(-1, G)
    prompt = packed.comp_start.cpu().view(-1, G)[:, 0]
    sizes = (lengths - prompt[:, None]).sum(1) + prompt  # one group's tokens: P + sum(c_i)
    budget = max_tokens or micro_batch_size * int(packed.lengths.max())
    order = torch.argsort(sizes, descending=True, stable=True).tolist()
    out: list[list[int]] = []
    cur: list[int] = []
    cur_max = 0
    for b in order:
        size = int(sizes[b])
        if cur and max(cur_max, size) * (len(cur) + 1) > budget:
            out.append(cur)
            cur, cur_max = [], 0
        cur.append(b)
        cur_max = max(cur_max, size)
    if cur:
        out.append(cur)
    return out


def _group_layout(packed: PackedRollout, groups: list[int], device: torch.device):
    """ids [k, L], positions [3, k, L], the attention mask [k, 1, L, L] (True: attend), and for each of the k * G
    rows the column of the hidden state predicting each completion token [k * G, T]."""
    G, T = packed.group_size, packed.completion_ids.shape[1]
    lengths, starts = packed.lengths.tolist(), packed.comp_start.tolist()
    sizes = [starts[b * G] + sum(lengths[b * G + i] - starts[b * G] for i in range(G)) for b in groups]
    k, L = len(groups), -(-max(sizes) // 16) * 16  # a multiple of 16: the masked SDPA kernels' alignment
    ids = torch.full((k, L), 0, dtype=torch.long, device=device)
    pos = torch.zeros(3, k, L, dtype=torch.long, device=device)
    seg = torch.full((k, L), -1, dtype=torch.long, device=device)  # 0 prompt, i + 1 completion i, -1 padding
    pred = torch.zeros(k * G, T, dtype=torch.long, device=device)
    src_ids, src_pos = packed.input_ids.to(device), packed.positions.to(device)
    t = torch.arange(T, device=device)
    for gi, b in enumerate(groups):
        r0, p = b * G, starts[b * G]
        ids[gi, :p], pos[:, gi, :p], seg[gi, :p] = src_ids[r0, :p], src_pos[:, r0, :p], 0
        cursor = p
        for i in range(G):
            r, c = r0 + i, lengths[r0 + i] - p
            ids[gi, cursor : cursor + c] = src_ids[r, p : p + c]
            pos[:, gi, cursor : cursor + c] = src_pos[:, r, p : p + c]
            seg[gi, cursor : cursor + c] = i + 1
            # token 0 is predicted by the prompt's last token, token t > 0 by completion token t - 1
            col = torch.where(t == 0, p - 1, cursor + t - 1).clamp(max=max(cursor + c - 1, p - 1))
            pred[gi * G + i] = col
            cursor += c
    q = torch.arange(L, device=device)
    causal = q[None, :] <= q[:, None]  # [L(query), L(key)]
    same = (seg[:, None, :] == 0) | (seg[:, None, :] == seg[:, :, None])  # key in the prompt or in the query's segment
    real = (seg >= 0)[:, None, :] & (seg >= 0)[:, :, None]
    mask = (causal[None] & same & real) | torch.eye(L, dtype=torch.bool, device=device)[None]  # padding sees itself
    return ids, pos, mask[:, None], pred


class SharedPromptLayout:
    """Micro-batches of whole groups, each a ``[prompt | completion 1 | ... | completion G]`` sequence (module doc)."""

    @staticmethod
    def batches(packed: PackedRollout, micro_batch_size: int, max_tokens: int | None) -> list[list[int]]:
        return group_micro_batches(packed, micro_batch_size, max_tokens)

    @staticmethod
    def forward(
        model,
        packed: PackedRollout,
        groups: list[int],
        feats,
        *,
        temperature,
        with_entropy,
        grad,
        checkpoint_layers,
        chunk_tokens,
        entropy_grad=False,
    ):
        """(rows [k * G], log-probs [k * G, T], entropies or None) of the groups' completions."""
        parts = model_parts(model)
        text = parts.text
        device = text.embed_tokens.weight.device
        impl = getattr(text.config, "_attn_implementation", "sdpa")
        if impl not in MASKED_IMPLEMENTATIONS:
            raise ValueError(
                f"--model.engines.update_engine packed_shared needs a masked attention implementation "
                f"({' or '.join(MASKED_IMPLEMENTATIONS)}), the policy has {impl!r}: set --model.policy.attn_implementation "
                "sdpa, or use --model.engines.update_engine packed"
            )
        G = packed.group_size
        ids, pos, mask, pred = _group_layout(packed, groups, device)
        off = packed.feat_offsets.tolist()
        index = lambda: torch.cat([torch.arange(off[b], off[b + 1]) for b in groups])  # noqa: E731
        h, img, deepstack = _embed(text, ids, feats, index, packed.image_token_id)
        if impl == "eager":  # an additive mask
            mask = torch.zeros(mask.shape, dtype=h.dtype, device=device).masked_fill(~mask, -math.inf)
        h = _decode(text, h, mask, pos, img, deepstack, grad=grad, checkpoint_layers=checkpoint_layers)
        row_group = torch.arange(len(groups), device=device).repeat_interleave(G)
        hid = h[row_group[:, None], pred]  # [k * G, T, H]
        rows = torch.tensor([b * G + i for b in groups for i in range(G)], device=device)
        logp, ent = _completion_scores(
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
        return rows, logp, ent


SHARED_PROMPT = SharedPromptLayout()


class SharedPromptUpdateEngine(PackedUpdateEngine):
    layout = SHARED_PROMPT
