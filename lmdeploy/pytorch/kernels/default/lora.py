"""LoRA for a batch mixing adapters: per-token gather of each token's adapter, shrink (x A^T) then expand (y B^T).

Layout of one LoRA-capable linear with `n` output slices (a `MergedLinear`'s shards; 1 for a plain linear) and
`S` adapter slots (slot 0 is the base model: all zeros), padded to a common rank `R`:

- `lora_a [S, n * R, in]`: rows `[i * R, (i + 1) * R)` are slice i's A (zero rows past an adapter's own rank);
- `lora_b [S, out, R]`: rows of slice i are that slice's B, already multiplied by the adapter's scaling
  (`lora_alpha / r`, or `/ sqrt(r)` with rsLoRA), as vLLM does at load time.

`out[t] += B[s_t] A[s_t] x[t]` slice by slice, where `s_t` is token t's slot. Zero padding makes ranks below `R`
exact, and slot 0 adds exactly zero.
"""
from __future__ import annotations

import torch


def lora_shrink_expand(x: torch.Tensor, out: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                       slice_sizes: list[int], token_slots: torch.Tensor) -> torch.Tensor:
    """Add every token's LoRA delta to `out` [T, out] in place and return it; `token_slots` [T] int64.

    The gather never materialises per-token weights: the shrink runs against every slot at once and picks each
    token's columns, and the expand multiplies a one-hot-by-slot copy of the shrunk activations with all slots'
    B stacked, so the cost is S times a single adapter's with no host synchronisation.
    """
    num_tokens = x.size(0)
    if num_tokens == 0:
        return out
    num_slots, stacked_rank, in_features = lora_a.shape
    rank = stacked_rank // len(slice_sizes)
    y = (x @ lora_a.reshape(num_slots * stacked_rank, in_features).t()).view(num_tokens, num_slots, stacked_rank)
    y = y.gather(1, token_slots.view(-1, 1, 1).expand(num_tokens, 1, stacked_rank)).squeeze(1)  # [T, n * R]
    one_hot = torch.zeros(num_tokens, num_slots, dtype=x.dtype, device=x.device)
    one_hot.scatter_(1, token_slots.view(-1, 1), 1)
    start = 0
    for i, size in enumerate(slice_sizes):
        y_i = (one_hot[:, :, None] * y[:, None, i * rank:(i + 1) * rank]).reshape(num_tokens, num_slots * rank)
        b_i = lora_b[:, start:start + size, :].permute(0, 2, 1).reshape(num_slots * rank, size)
        out[:, start:start + size] += y_i @ b_i
        start += size
    return out


def lora_reference(x: torch.Tensor, out: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                   slice_sizes: list[int], token_slots: torch.Tensor) -> torch.Tensor:
    """Token by token, slice by slice, in float64: the plain definition, for tests of the fast forms."""
    rank = lora_a.size(1) // len(slice_sizes)
    result = out.double().clone()
    for t, slot in enumerate(token_slots.tolist()):
        start = 0
        for i, size in enumerate(slice_sizes):
            a = lora_a[slot, i * rank:(i + 1) * rank].double()
            b = lora_b[slot, start:start + size].double()
            result[t, start:start + size] += b @ (a @ x[t].double())
            start += size
    return result
