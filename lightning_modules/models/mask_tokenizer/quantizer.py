"""Residual vector quantisation with EMA codebooks: the two-code bottleneck of the mask tokenizers.

``ResidualQuantizer(depth=2, size=256, dim=D)`` turns a latent ``z [B, D]`` into ``depth`` codes: codebook 0 quantises
``z``, codebook 1 the residual ``z - e0[c0]``, and the quantised latent is ``e0[c0] + e1[c1]``. The codebooks are not
shared (CycleGRPO's ``mask_tokenizer_256x2``: two unshared 256-entry codebooks).

Training, as VQ-VAE-2 / SoundStream / the released VQ-SAM2 do it:

- **straight-through** gradient: the decoder sees ``z + (q - z).detach()``, so the encoder gets the decoder's gradient;
- **commitment loss** ``mean_k ||z - q_k.detach()||^2`` over the cumulative quantisations ``q_1 = e0[c0]``,
  ``q_2 = e0[c0] + e1[c1]`` (the released code's "cumsum" form): the encoder stays near what the codes can say;
- **EMA codebook updates** (decay 0.99; no codebook gradient), with **k-means initialisation** from the first
  latents seen (``init_from``) and **dead-code restarts**: a code no latent picked in the last ``patience`` training
  steps is moved onto a random residual of the current batch, so all 256 entries stay in use.

The codebook tensors are buffers ``embed [depth, size, dim]`` (``state_dict`` keys ``embed``, ``cluster_size``,
``embed_sum``, ``idle``, ``initted``); ``vq_sam2.py`` maps the released layout (``quantizer.codebooks.{i}.weight`` with a padding
row) onto them.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["ResidualQuantizer", "kmeans"]


@torch.no_grad()
def kmeans(x: torch.Tensor, k: int, iters: int = 10, generator: torch.Generator | None = None) -> torch.Tensor:
    """``k`` centroids of the rows of ``x [N, D]`` (Lloyd's algorithm from a random subset; an empty cluster keeps its
    centroid). With fewer rows than ``k`` the rows are tiled with small noise."""
    n = x.shape[0]
    if n < k:
        reps = (k + n - 1) // n
        noise = torch.randn(reps * n, x.shape[1], generator=generator, dtype=x.dtype) * 1e-3
        x = x.repeat(reps, 1) + noise.to(x.device)
        n = x.shape[0]
    centroids = x[torch.randperm(n, generator=generator)[:k].to(x.device)].clone()
    for _ in range(iters):
        assign = torch.cdist(x, centroids).argmin(1)  # [N]
        sums = torch.zeros_like(centroids).index_add_(0, assign, x)
        counts = torch.bincount(assign, minlength=k).to(x.dtype)
        filled = counts > 0
        centroids[filled] = sums[filled] / counts[filled, None]
    return centroids


class ResidualQuantizer(nn.Module):
    """``depth`` unshared EMA codebooks of ``size`` entries of dimension ``dim``, applied residually."""

    def __init__(self, depth: int = 2, size: int = 256, dim: int = 64, decay: float = 0.99, patience: int = 40):
        super().__init__()
        self.depth, self.size, self.dim = depth, size, dim
        self.decay, self.patience = decay, patience
        self.register_buffer("embed", torch.randn(depth, size, dim) * 0.1)
        self.register_buffer("cluster_size", torch.ones(depth, size))
        self.register_buffer("embed_sum", self.embed.clone())
        self.register_buffer("idle", torch.zeros(depth, size))
        self.register_buffer("initted", torch.zeros((), dtype=torch.bool))

    # --- codes <-> vectors ----------------------------------------------------------------------------------------

    def lookup(self, codes: torch.Tensor) -> torch.Tensor:
        """``codes [B, depth]`` -> quantised latent ``[B, dim]`` (sum of the codebook entries). A code of -1 (the
        released decoder's "no second code") contributes nothing."""
        out = torch.zeros(codes.shape[0], self.dim, dtype=self.embed.dtype, device=self.embed.device)
        for k in range(min(codes.shape[1], self.depth)):
            c = codes[:, k]
            valid = c >= 0
            out = out + self.embed[k][c.clamp(min=0)] * valid[:, None].to(out.dtype)
        return out

    @torch.no_grad()
    def encode(self, z: torch.Tensor) -> torch.Tensor:
        """``z [B, dim]`` -> ``codes [B, depth]`` (nearest entry of each codebook to the running residual)."""
        residual = z.detach().clone()
        codes = []
        for k in range(self.depth):
            c = torch.cdist(residual, self.embed[k]).argmin(1)
            codes.append(c)
            residual -= self.embed[k][c]
        return torch.stack(codes, 1)

    # --- training -------------------------------------------------------------------------------------------------

    @torch.no_grad()
    def init_from(self, z: torch.Tensor, generator: torch.Generator | None = None) -> None:
        """k-means initialisation, codebook by codebook on the residuals of ``z [N, dim]``."""
        residual = z.detach().clone()
        for k in range(self.depth):
            centroids = kmeans(residual, self.size, generator=generator)
            self.embed[k] = centroids
            self.embed_sum[k] = centroids
            self.cluster_size[k] = 1.0
            self.idle[k] = 0.0
            residual -= centroids[torch.cdist(residual, centroids).argmin(1)]
        self.initted.fill_(True)

    @torch.no_grad()
    def _ema_update(self, k: int, residual: torch.Tensor, codes: torch.Tensor, generator) -> None:
        onehot = torch.zeros(residual.shape[0], self.size, dtype=residual.dtype, device=residual.device)
        onehot[torch.arange(residual.shape[0]), codes] = 1.0
        self.cluster_size[k].mul_(self.decay).add_(onehot.sum(0), alpha=1 - self.decay)
        self.embed_sum[k].mul_(self.decay).add_(onehot.t() @ residual, alpha=1 - self.decay)
        n = self.cluster_size[k].sum()
        smoothed = (self.cluster_size[k] + 1e-5) / (n + self.size * 1e-5) * n  # Laplace smoothing
        self.embed[k] = self.embed_sum[k] / smoothed[:, None]
        used = onehot.sum(0) > 0
        self.idle[k] = torch.where(used, torch.zeros_like(self.idle[k]), self.idle[k] + 1)
        dead = self.idle[k] > self.patience
        if dead.any():  # restart dead codes on random residuals of this batch (with a little noise)
            pick = torch.randint(0, residual.shape[0], (int(dead.sum()),), generator=generator).to(residual.device)
            noise = torch.randn(len(pick), self.dim, generator=generator).to(residual) * 0.01
            self.embed[k][dead] = residual[pick] + noise
            self.embed_sum[k][dead] = self.embed[k][dead]
            self.cluster_size[k][dead] = 1.0
            self.idle[k][dead] = 0.0

    def forward(
        self, z: torch.Tensor, generator: torch.Generator | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``z [B, dim]`` -> ``(q_st [B, dim], commitment loss [], codes [B, depth])``; in training mode the
        codebooks take an EMA step towards this batch."""
        residual = z.detach().clone()
        total = torch.zeros_like(z)
        losses, codes = [], []
        for k in range(self.depth):
            with torch.no_grad():
                c = torch.cdist(residual, self.embed[k]).argmin(1)
                if self.training:
                    self._ema_update(k, residual, c, generator)
                q = self.embed[k][c]
            codes.append(c)
            residual = residual - q
            total = total + q
            losses.append((z - total.detach()).pow(2).mean())
        q_st = z + (total - z).detach()
        return q_st, torch.stack(losses).mean(), torch.stack(codes, 1)
