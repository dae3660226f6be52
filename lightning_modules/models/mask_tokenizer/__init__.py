"""Mask tokenizers: a mask on an image <-> two codes (docs/mask_tokens.md).

``base.MaskTokenizer`` is the interface; ``toy.ToyMaskTokenizer`` the small VQ tokenizer trained on the toy world
(``python -m cli.mask_tokenizer``); ``vq_sam2.VQSam2MaskTokenizer`` the released VQ-SAM2 architecture on transformers'
SAM 2; ``vocab.add_mask_tokens`` puts the 514 mask-token strings into a policy's tokenizer and embeddings.
Submodules import torch (and transformers) lazily from here: import what you use.
"""

from lightning_modules.models.mask_tokenizer.base import Codes, MaskTokenizer

__all__ = ["Codes", "MaskTokenizer"]
