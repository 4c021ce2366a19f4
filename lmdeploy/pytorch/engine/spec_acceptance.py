"""Verification of K draft tokens against the target's K + 1 next-token distributions of one verify forward.

Row b of a verify forward feeds [x, d_1 .. d_K] (the last committed token, then the drafts) and yields target
distributions p_0 .. p_K, where p_i is the target's next-token distribution after x, d_1 .. d_i.

- Greedy: d_{i+1} is accepted while it equals argmax p_i; the step emits the accepted drafts and then argmax of the
  first unmatched position (or of p_K when all K match): the tokens plain greedy decoding would emit, 1 .. K + 1.
- Sampling (rejection sampling, Leviathan et al. / Chen et al. 2023): draft d_{i+1} was drawn from the draft
  distribution q_i; it is accepted with probability min(1, p_i(d) / q_i(d)); at the first rejection the step
  emits a token from norm(max(0, p_i - q_i)) and stops; when all K pass it emits a bonus token from p_K. The
  emitted stream is distributed exactly as sampling from the target alone.

`Acceptance.tokens[b, :num_accepted[b] + 1]` is what row b emits; `num_accepted[b]` (0 .. K) is also the number of
draft positions whose KV and recurrent state become committed (the verify forward's position `num_accepted[b]`,
counted from 0 at x, holds the state after the last emitted-but-one token).
"""
from __future__ import annotations

from typing import NamedTuple

import torch


class Acceptance(NamedTuple):
    num_accepted: torch.Tensor  # [B] int64 in [0, K]
    tokens: torch.Tensor        # [B, K + 1] int64; row b emits tokens[b, :num_accepted[b] + 1]


def _leading_true(mask: torch.Tensor) -> torch.Tensor:
    """[B, K] bool -> [B] count of leading True values."""
    return mask.to(torch.int64).cumprod(dim=1).sum(dim=1)


def greedy_accept(draft_ids: torch.Tensor, target_logits: torch.Tensor) -> Acceptance:
    """`draft_ids` [B, K], `target_logits` [B, K + 1, V]."""
    target = target_logits.argmax(dim=-1)
    k = draft_ids.size(1)
    return Acceptance(_leading_true(draft_ids == target[:, :k]), target)


def rejection_sample(draft_ids: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor,
                     generator: torch.Generator | None = None) -> Acceptance:
    """`draft_ids` [B, K] drawn from `draft_probs` [B, K, V]; `target_probs` [B, K + 1, V] (rows sum to 1)."""
    batch, k = draft_ids.shape
    rows = torch.arange(batch, device=draft_ids.device)[:, None]
    cols = torch.arange(k, device=draft_ids.device)[None, :]
    p = target_probs[rows, cols, draft_ids]
    q = draft_probs[rows, cols, draft_ids]
    u = torch.rand(batch, k, generator=generator, device=draft_ids.device)
    accepted = u * q < p  # u < p / q without dividing; q > 0 for a drawn draft
    num = _leading_true(accepted)
    # residual at the first rejected position; at num == K the bonus draws from p_K itself
    at = num.clamp(max=k - 1)
    residual = (target_probs[torch.arange(batch), at] - draft_probs[torch.arange(batch), at]).clamp_min(0)
    fallback = target_probs[torch.arange(batch), at]  # p == q on the support: any draw from p is exact
    mass = residual.sum(dim=-1, keepdim=True)
    residual = torch.where(mass > 0, residual / mass.clamp_min(1e-30), fallback)
    final = torch.where((num == k)[:, None], target_probs[:, k], residual)
    extra = torch.multinomial(final, 1, generator=generator)[:, 0]
    tokens = torch.cat([draft_ids, draft_ids[:, :1]], dim=1).clone()
    tokens[torch.arange(batch), num] = extra
    return Acceptance(num, tokens)
