"""Mask tokens in the policy's vocabulary: the 514 strings of ``core.regions.mask_tokens`` as atomic added tokens.

``add_mask_tokens(model, processor)`` adds ``<|mt_start|>``, ``<|mt_0000|>``..``<|mt_0511|>``, ``<|mt_end|>`` to the
processor's tokenizer and gives each a row of the policy's input embeddings (and of the LM head when it is not tied)
initialised to the **mean of the existing rows** (deterministic, so every rank of a DDP run agrees without a
broadcast; the mean row's logit is the average logit, so a fresh token is neither favoured nor ruled out).

- Each string is one token (never split into ``<|``, ``m``, ``t`` ...); the tokens are added as *non-special* added
  tokens (``AddedToken(special=False, normalized=False)``), because the rollout decodes completions with
  ``skip_special_tokens=True`` (``engines/base.py``), which would delete special tokens before the reward reads them.
- In the repository's order (``<|mt_end|>`` last, its ``add_special_tokens.py``), so the ids line up with a released
  tokenizer's; tokens are looked up by string, so a tokenizer saved in the earlier order (``<|mt_end|>`` second)
  keeps its ids and still works.
- Idempotent: a checkpoint saved after ``add_mask_tokens`` (a cold-start co-SFT policy) already has them, and a second
  call adds nothing and touches no weights.
- ``python -m cli.mask_tokenizer --add-to-policy SRC --out DST`` writes a checkpoint that has them: what an engine
  that loads its weights from a folder (vLLM) needs, since it takes the vocabulary size from the folder, not from the
  module the trainer changed.
- When the embedding matrix already has spare rows (Qwen2.5-VL pads its 151,665 tokens to 151,936 rows), the new ids
  land in them; those rows are re-initialised to the mean of the rows in use, and the matrix only grows when needed.
"""

from __future__ import annotations

from typing import Any

import torch

from core.regions.mask_tokens import mask_token_strings

__all__ = ["add_mask_tokens", "mask_token_ids"]


def _tokenizer(processor: Any):
    return getattr(processor, "tokenizer", processor)


def mask_token_ids(processor: Any) -> list[int]:
    """The ids of ``mask_token_strings()`` in the processor's tokenizer (vocabulary order); raises when one is
    missing (the policy was loaded without ``--model.policy.mask_tokens true``)."""
    tok = _tokenizer(processor)
    vocab = tok.get_vocab()
    missing = [s for s in mask_token_strings() if s not in vocab]
    if missing:
        raise ValueError(
            f"{len(missing)} mask tokens (e.g. {missing[0]!r}) are not in the tokenizer: load the policy with "
            "--model.policy.mask_tokens true (lightning_modules.models.mask_tokenizer.vocab.add_mask_tokens)"
        )
    return [vocab[s] for s in mask_token_strings()]


@torch.no_grad()
def add_mask_tokens(model: Any, processor: Any) -> list[int]:
    """Add the mask tokens to ``processor``'s tokenizer and ``model``'s embeddings (module docstring); returns their
    ids in ``mask_token_strings()`` order."""
    from tokenizers import AddedToken

    tok = _tokenizer(processor)
    vocab = tok.get_vocab()
    strings = mask_token_strings()
    new = [s for s in strings if s not in vocab]
    if not new:
        return mask_token_ids(processor)
    n_used = len(tok)  # rows of real tokens before the addition
    tok.add_tokens([AddedToken(s, special=False, normalized=False, single_word=False) for s in new])
    ids = mask_token_ids(processor)
    fresh = [i for s, i in zip(strings, ids) if s in set(new)]
    emb = model.get_input_embeddings()
    if len(tok) > emb.weight.shape[0]:
        model.resize_token_embeddings(len(tok), mean_resizing=False)
        emb = model.get_input_embeddings()
    rows = torch.tensor(fresh, device=emb.weight.device)
    mean = emb.weight[:n_used].float().mean(0).to(emb.weight.dtype)
    emb.weight[rows] = mean
    head = model.get_output_embeddings()
    if head is not None and head.weight.data_ptr() != emb.weight.data_ptr():
        head.weight[rows] = head.weight[:n_used].float().mean(0).to(head.weight.dtype)
        if getattr(head, "bias", None) is not None:
            head.bias[rows] = head.bias[:n_used].float().mean().to(head.bias.dtype)
    return ids
