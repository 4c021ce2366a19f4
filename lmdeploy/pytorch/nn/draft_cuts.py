"""State cuts of a verify forward (MTP speculative decoding) in a form CUDA graphs can replay.

A verify forward of K drafts feeds every sequence exactly K + 1 tokens, packed in order (row b's tokens are
`b * (K + 1) .. b * (K + 1) + K`), and keeps the state after each of its first K prefixes in the pool rows
`ModelInputs.draft_state_slots[b]` (after j + 1 tokens: column j). These are the in-prefill cuts of `state_cuts` at
offsets 1 .. K, but every index here follows from the shape (B, K) and device tensors alone: nothing is built
from host lists, nothing is uploaded, so a captured graph replays it on new slots and states.

- Conv history at the cut after j + 1 tokens: the last `width` conv inputs before it (the pool's history width,
  the conv kernel size - 1), taken from the packed inputs where they lie inside the row and from the row's old
  history otherwise (zeros for a fresh row), written before the conv kernel overwrites the old history.
- Gated delta rule: K + 1 rounds, round r runs token r of every row as one decode batch (continuing from the
  row's pool state, fresh only in round 0), then copies the row's state into column r of its cut slots (r < K).
  By the kernels' contract this is exactly what the rounds of `state_cuts` compute for the same cuts.
"""
from __future__ import annotations

import dataclasses

import torch

from ..model_inputs import ModelInputs


def _conv_index(inputs: ModelInputs, width: int, device: torch.device) -> dict[str, torch.Tensor]:
    """Gather indices of the conv history at every cut, [B, K, width] / [K, width], from the shape alone."""
    batch, k = inputs.draft_state_slots.shape
    rel = torch.arange(1, k + 1, device=device)[:, None] - width + torch.arange(width, device=device)[None, :]
    bos = torch.arange(batch, device=device) * (k + 1)
    return dict(x_index=(bos[:, None, None] + rel[None]).clamp(min=0), from_x=rel >= 0,
                hist_col=(width + rel).clamp(0, width - 1))


def save_conv_draft_cuts(x: torch.Tensor, conv_state: torch.Tensor, inputs: ModelInputs) -> None:
    """x [B * (K + 1), C], conv_state pool [num_slots, C, width]: the history at each cut into its pool row."""
    slots = inputs.draft_state_slots
    batch, k = slots.shape
    width, channels = conv_state.shape[-1], conv_state.shape[1]
    idx = inputs.derived(('draft_conv_index', width, x.device), lambda: _conv_index(inputs, width, x.device))
    from_x = x[idx['x_index'].reshape(-1)].view(batch, k, width, channels).transpose(2, 3).to(conv_state.dtype)
    old = conv_state[inputs.state_ids].masked_fill(inputs.is_fresh.view(-1, 1, 1), 0)       # [B, C, width]
    hist = old[:, None].expand(batch, k, channels, width)
    hist = hist.gather(3, idx['hist_col'][None, :, None, :].expand(batch, k, channels, width))
    conv_state[slots.reshape(-1)] = torch.where(idx['from_x'][None, :, None, :], from_x, hist).reshape(
        batch * k, channels, width)


def _round_inputs(inputs: ModelInputs) -> tuple[ModelInputs, ModelInputs]:
    """Decode-shaped inputs of one round: (round 0: the rows' own fresh flags; later rounds: never fresh)."""
    batch = inputs.draft_state_slots.shape[0]
    dev = inputs.state_ids.device
    first = dataclasses.replace(
        inputs, q_lens=torch.ones(batch, dtype=torch.int64, device=dev),
        cu_seqlens_q=torch.arange(batch + 1, dtype=torch.int64, device=dev),
        kv_lens=inputs.kv_lens, q_lens_list=[1] * batch, max_seqlen_q=1, state_cuts=None, draft_state_slots=None,
        use_recurrent_kernel=False, graph_chunk_indices=None)
    later = dataclasses.replace(first, is_fresh=torch.zeros_like(inputs.is_fresh))
    return first, later


def gated_delta_draft_rounds(impl, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                             beta: torch.Tensor, state: torch.Tensor, inputs: ModelInputs, use_qk_l2norm: bool
                             ) -> torch.Tensor:
    """The gated delta rule of a verify forward with its draft cuts (`impl`: the backend op, decode calls only)."""
    slots = inputs.draft_state_slots
    batch, num_cuts = slots.shape
    rows = num_cuts + 1

    def token(t: torch.Tensor, r: int) -> torch.Tensor:
        return t.unflatten(0, (batch, rows))[:, r].contiguous()
    first, later = inputs.derived('draft_round_inputs', lambda: _round_inputs(inputs))  # once per forward
    out = v.new_empty(v.shape)
    for r in range(rows):
        o = impl(token(q, r), token(k, r), token(v, r), token(g, r), token(beta, r), state, first if r == 0 else later,
                 use_qk_l2norm=use_qk_l2norm)
        out.unflatten(0, (batch, rows))[:, r] = o
        if r < num_cuts:
            state[slots[:, r]] = state[inputs.state_ids]
    return out
