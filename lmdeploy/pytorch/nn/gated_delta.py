"""Gated DeltaNet building blocks: the short causal convolution, the gating, and the gated delta rule itself.

Both stateful ops continue every sequence from its row of the state pool (`ctx.inputs.state_ids`, or from zeros
when `ctx.inputs.is_fresh`) and leave the state after the fed tokens in that row, so chunked prefill, decode and
mixed batches all compose. Implementations come from the backend (`OpType.CausalConv1d`, `OpType.GatedDeltaRule`,
`OpType.GatedDeltaGating`).

In-prefill checkpoints (`ctx.inputs.state_cuts`) also leave the state at chosen steps inside a prefill in other
pool rows, without splitting the forward: the conv history at a cut is the K-1 conv inputs before it (read from the
inputs, or the old history for a cut closer than K-1 to the segment start), and the gated delta rule runs in rounds
over the segments between cuts, each round one kernel call for all rows that still have a segment, copying the
state of rows that reached a cut. By the kernels' contract (continue from the pool row) the rounds compute exactly
what one call would, up to float rounding at the segment edges. Verify forwards of MTP speculative decoding take
the same cuts in a shape-only form that CUDA graphs replay (`ModelInputs.draft_state_slots`, see `draft_cuts`);
a backend op with a `draft_cuts` entry (the `cuda` backend's pool kernel) computes them in one launch instead.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from torch import nn

from ..backends.base import OpType
from ..backends.selector import current_backend
from ..model_inputs import ModelInputs, StateCuts, upload_index_tensors
from .draft_cuts import gated_delta_draft_rounds, save_conv_draft_cuts
from .norm import GatedRMSNorm


class CausalConv1d(nn.Module):
    """Depthwise causal conv over packed varlen tokens; keeps the last `kernel_size - 1` inputs per sequence.

    The weight keeps the checkpoint's `nn.Conv1d` shape `[channels, 1, kernel_size]`.
    """

    def __init__(self, channels: int, kernel_size: int, bias: bool = False, activation: str | None = 'silu'):
        super().__init__()
        self.channels = channels
        self.kernel_size = kernel_size
        self.activation = activation
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel_size), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(channels), requires_grad=False) if bias else None
        self._impl = current_backend().build(OpType.CausalConv1d)

    def forward(self, x: torch.Tensor, conv_state: torch.Tensor, inputs: ModelInputs,
                out_splits: Sequence[int] | None = None) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """x [T, C], conv_state pool [num_slots, C, K-1] -> [T, C]; with `out_splits` (at most three channel group
        widths summing to C) the groups `out.split(out_splits, -1)`, which the `cuda` backend writes as
        contiguous tensors unless `LMDEPLOY_FUSED_PREFILL=0`."""
        if inputs.state_cuts is not None:
            save_conv_cuts(x, conv_state, inputs)  # before the kernel overwrites the old histories
        elif inputs.draft_state_slots is not None:
            save_conv_draft_cuts(x, conv_state, inputs)
        splits = None if out_splits is None else tuple(out_splits)
        return self._impl(x, self.weight.squeeze(1), self.bias, conv_state, inputs, self.activation, splits)


def _row_starts(cuts: StateCuts) -> list[int]:
    starts = [0]
    for n in cuts.q_lens:
        starts.append(starts[-1] + n)
    return starts


def _conv_cut_index(cuts: StateCuts, width: int, device: torch.device) -> dict[str, torch.Tensor]:
    """Gather indices of the conv history at every cut: column j (oldest first) is the input at segment position
    `offset - width + j`, from the packed inputs when >= 0, else from the old history column `width + position`."""
    starts = _row_starts(cuts)
    rel = torch.tensor(cuts.offsets, dtype=torch.int64)[:, None] - width + torch.arange(width)[None, :]
    bos = torch.tensor([starts[r] for r in cuts.rows], dtype=torch.int64)[:, None]
    fresh = torch.tensor([cuts.is_fresh[r] for r in cuts.rows], dtype=torch.bool)
    out = dict(x_index=(bos + rel).clamp(min=0), from_x=rel >= 0, hist_col=(width + rel).clamp(0, width - 1),
               src=torch.tensor([cuts.state_ids[r] for r in cuts.rows], dtype=torch.int64), fresh=fresh,
               dst=torch.tensor(cuts.slots, dtype=torch.int64))
    return upload_index_tensors(out, device)


def save_conv_cuts(x: torch.Tensor, conv_state: torch.Tensor, inputs: ModelInputs) -> None:
    """Write the conv history at each cut (the last K-1 inputs before it) into the cut's pool row."""
    width = conv_state.shape[-1]
    idx = inputs.derived(('conv_cuts', width, x.device), lambda: _conv_cut_index(inputs.state_cuts, width, x.device))
    from_x = x[idx['x_index']].transpose(1, 2).to(conv_state.dtype)              # [n, C, K-1]
    hist = conv_state[idx['src']]                                                 # [n, C, K-1]
    hist = hist.gather(2, idx['hist_col'][:, None, :].expand_as(hist))
    hist = hist.masked_fill(idx['fresh'][:, None, None], 0)
    conv_state[idx['dst']] = torch.where(idx['from_x'][:, None, :], from_x, hist)


class GatedDeltaGating(nn.Module):
    """`gated_delta_gating` from the backend (the `cuda` backend fuses its eight small ops into one launch)."""

    def __init__(self):
        super().__init__()
        self._impl = current_backend().build(OpType.GatedDeltaGating)

    def forward(self, a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        return self._impl(a, b, A_log, dt_bias)


class GatedDeltaRule(nn.Module):
    """The gated delta rule over packed varlen sequences (no parameters).

    q, k [T, Hk, Dk]; v [T, H, Dv] with H a multiple of Hk (value head h reads key head h // (H // Hk));
    g, beta [T, H]; state pool [num_slots, H, Dk, Dv]. The backend picks the recurrent form for pure decode
    batches and the chunked form otherwise.
    """

    def __init__(self, use_qk_l2norm: bool = True):
        super().__init__()
        self.use_qk_l2norm = use_qk_l2norm
        self._impl = current_backend().build(OpType.GatedDeltaRule)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                state: torch.Tensor, inputs: ModelInputs) -> torch.Tensor:
        if inputs.draft_state_slots is not None and inputs.state_cuts is None:
            fused = getattr(self._impl, 'draft_cuts', None)   # a backend's verify-with-cuts kernel, if any
            out = None if fused is None else fused(q, k, v, g, beta, state, inputs, use_qk_l2norm=self.use_qk_l2norm)
            if out is not None:
                return out
            return gated_delta_draft_rounds(self._impl, q, k, v, g, beta, state, inputs, self.use_qk_l2norm)
        if inputs.state_cuts is None:
            return self._impl(q, k, v, g, beta, state, inputs, use_qk_l2norm=self.use_qk_l2norm)
        rounds = inputs.derived(('rounds', q.device), lambda: _rounds(inputs, q.device))
        out = v.new_empty(v.shape)
        for round_inputs, index, save_src, save_dst in rounds:
            out[index] = self._impl(q[index], k[index], v[index], g[index], beta[index], state, round_inputs,
                                    use_qk_l2norm=self.use_qk_l2norm)
            if save_dst.numel():
                state[save_dst] = state[save_src]
        return out

    def forward_gating(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                       A_log: torch.Tensor, dt_bias: torch.Tensor, gating: GatedDeltaGating, state: torch.Tensor,
                       inputs: ModelInputs, norm: GatedRMSNorm | None = None, z: torch.Tensor | None = None
                       ) -> torch.Tensor:
        """`forward(q, k, v, *gating(a, b, A_log, dt_bias), state, inputs)`, then `norm(out, z)` when a gated output
        norm (`nn.norm.GatedRMSNorm`) is given. A backend op with a `with_gating` entry (the `cuda` backend's pool
        kernel, for decode and graph-replayed prefills) computes the gating, and with `LMDEPLOY_FOLD_OUT_NORM=1` the
        output norm, inside the rule's kernel instead: up to two launches less a layer. Forwards with cuts gate first
        and norm last."""
        fused = getattr(self._impl, 'with_gating', None)
        if fused is not None and inputs.state_cuts is None and inputs.draft_state_slots is None:
            out_norm = None if norm is None else (z, norm.weight, norm.eps)
            out = fused(q, k, v, a, b, A_log, dt_bias, state, inputs, use_qk_l2norm=self.use_qk_l2norm,
                        out_norm=out_norm)
            if out is not None:
                return out
        g, beta = gating(a, b, A_log, dt_bias)
        out = self(q, k, v, g, beta, state, inputs)
        return out if norm is None else norm(out, z)


def _rounds(inputs: ModelInputs, device: torch.device) -> list[tuple]:
    """Per round: (inputs of the segments it runs, their packed tokens (a slice when contiguous, else an index
    tensor), state rows to copy after it)."""
    cuts = inputs.state_cuts
    starts = _row_starts(cuts)
    bounds = [[0, cuts.q_lens[r]] for r in range(len(cuts.q_lens))]
    dst_at: dict[tuple[int, int], int] = {}
    for row, offset, slot in zip(cuts.rows, cuts.offsets, cuts.slots):
        bounds[row].append(offset)
        dst_at[(row, offset)] = slot
    bounds = [sorted(set(b)) for b in bounds]
    rounds = []
    for r in range(max(len(b) for b in bounds) - 1):
        pieces, lens, slots, fresh, save_src, save_dst = [], [], [], [], [], []
        for row, b in enumerate(bounds):
            if r + 1 >= len(b):
                continue
            lo, hi = b[r], b[r + 1]
            if pieces and pieces[-1][1] == starts[row] + lo:  # continues the previous piece
                pieces[-1][1] = starts[row] + hi
            else:
                pieces.append([starts[row] + lo, starts[row] + hi])
            lens.append(hi - lo)
            slots.append(cuts.state_ids[row])
            fresh.append(cuts.is_fresh[row] and r == 0)
            if (row, hi) in dst_at:
                save_src.append(cuts.state_ids[row])
                save_dst.append(dst_at[(row, hi)])
        cu = [0]
        for n in lens:
            cu.append(cu[-1] + n)
        host = dict(q_lens=torch.tensor(lens), cu_seqlens_q=torch.tensor(cu), state_ids=torch.tensor(slots),
                    is_fresh=torch.tensor(fresh, dtype=torch.bool), save_src=torch.tensor(save_src, dtype=torch.int64),
                    save_dst=torch.tensor(save_dst, dtype=torch.int64))
        # One contiguous token range (e.g. a single long prompt) is a slice: a view, no gather and no index upload.
        if len(pieces) > 1:
            host['index'] = torch.cat([torch.arange(lo, hi) for lo, hi in pieces])
        dev = upload_index_tensors(host, device)
        round_inputs = dataclasses.replace(
            inputs, q_lens=dev['q_lens'], cu_seqlens_q=dev['cu_seqlens_q'], state_ids=dev['state_ids'],
            is_fresh=dev['is_fresh'], q_lens_list=lens, max_seqlen_q=max(lens), state_cuts=None)
        index = dev['index'] if len(pieces) > 1 else slice(*pieces[0])
        rounds.append((round_inputs, index, dev['save_src'], dev['save_dst']))
    return rounds
