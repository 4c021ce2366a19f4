"""Gated delta rule on fla-core kernels, with the contract of `kernels/default/gated_delta_rule.py`.

Each call: gather float32 initial states from the pool rows (zeros where fresh, so a slot's stale contents never
reach the result), run fla over the packed batch as one varlen sequence set (batch 1 + ``cu_seqlens``), and
scatter the final states back into the pool rows in the pool dtype. fla supports grouped value heads natively
(value head h reads key head ``h // (H // Hk)``, the mapping of the reference), so q and k are passed unexpanded.

fla derives its varlen chunk indices from ``cu_seqlens`` on the device, which reads a length sum back to the host
(a stream synchronisation), and memoises them by the identity of the ``cu_seqlens`` tensor object; so callers
must not mutate a ``cu_seqlens`` tensor in place between calls. The chunked entry point also takes the indices
precomputed (``chunk_indices``, see `chunk_indices_host`), which the engine builds from host lengths and uploads
without a synchronisation. fla is imported inside the functions so this module imports without it.

Inside a CUDA graph (`engine/cuda_graph.py`) the chunked path runs on static buffers rewritten in place between
replays: ``cu_seqlens`` of the bucket's sequence count and ``chunk_indices`` of a fixed row count
(`max_graph_chunks`), built on the host by `padded_chunk_indices_host`. The padding rows name chunk 0 of an
*empty* sequence, which every fla kernel masks out entirely (its length is 0), so the grids are fixed per bucket
and the padding computes nothing; the real rows come first and in order, so each row's position is still the
global chunk index fla's output kernel reads the chunk states by. fla also derives chunk offsets from
``cu_seqlens`` on the device (its chunk offsets, five small launches) and memoises them by tensor identity, so
a static ``cu_seqlens`` reaches fla as ``cu_seqlens_view``: a view of the buffer made once per forward (once per
capture) and shared by that forward's layers, so the first layer derives the offsets (inside the graph, on the
lengths of each replay) and the others reuse them, while no forward reuses offsets another one derived on other
lengths (`backends/cuda.forward_memo`).
"""
from __future__ import annotations

import numpy as np
import torch

from . import state_rows


def _load_states(state: torch.Tensor, state_ids: torch.Tensor, is_fresh: torch.Tensor) -> torch.Tensor:
    """Contiguous float32 initial states ``[B, H, Dk, Dv]``; fresh rows are zero whatever the slot holds (one copy
    kernel, `state_rows.gather_state_rows`, for a CUDA pool whose slots are each contiguous, as the engine's are,
    unless `LMDEPLOY_STATE_ROWS=0`)."""
    if state_rows.ENABLED and state.is_cuda and state_rows.slots_contiguous(state):
        return state_rows.gather_state_rows(state, state_ids, is_fresh)
    init = state[state_ids].to(torch.float32, memory_format=torch.contiguous_format)  # a fresh copy
    fresh = is_fresh.to(device=init.device, dtype=torch.bool).view(-1, 1, 1, 1)
    return init.masked_fill_(fresh, 0.0)  # fill, not multiply: NaN garbage in a fresh slot must not survive


def _store_states(state: torch.Tensor, state_ids: torch.Tensor, final: torch.Tensor) -> None:
    """Scatter final states into the pool in place (one copy kernel for a CUDA pool whose slots are each contiguous,
    unless `LMDEPLOY_STATE_ROWS=0`; else index_put, so any strided pool works)."""
    if state_rows.ENABLED and state.is_cuda and state_rows.slots_contiguous(state):
        state_rows.scatter_state_rows(state, state_ids, final)
    elif state_ids.numel() > 0:
        state[state_ids] = final.to(state.dtype)


def check_shapes(q, k, v, g, beta, cu_seqlens, state, state_ids, is_fresh) -> None:
    """The layout contract of the gated delta rule kernels (`kernels/default/gated_delta_rule.py`)."""
    num_tokens, num_k_heads, dim_k = q.shape
    num_heads, dim_v = v.shape[1:]
    assert k.shape == q.shape, f'k {tuple(k.shape)} != q {tuple(q.shape)}'
    assert v.shape[0] == num_tokens and g.shape == beta.shape == (num_tokens, num_heads), 'bad v/g/beta shapes'
    assert num_heads % num_k_heads == 0, f'value heads {num_heads} not a multiple of key heads {num_k_heads}'
    assert state.shape[1:] == (num_heads, dim_k, dim_v), f'bad state pool shape {tuple(state.shape)}'
    assert cu_seqlens.shape == (state_ids.shape[0] + 1,) and is_fresh.shape == state_ids.shape


def chunk_indices_host(q_lens: list[int], chunk_size: int = 64) -> torch.Tensor:
    """fla's varlen chunk indices on the host: one row ``(sequence, chunk within it)`` per ``chunk_size``-token
    chunk of each sequence (a partial last chunk counts), in order; int64 ``[num_chunks, 2]``."""
    # numpy, not torch: torch's CPU repeat_interleave runs a parallel region per call, and waking the intra-op
    # threads cost ~1.7 ms per call on the H200 host (run 19's suffix profile), on every prefill graph's fill
    counts = -(-np.asarray(q_lens, dtype=np.int64) // chunk_size)
    seq = np.repeat(np.arange(len(q_lens), dtype=np.int64), counts)
    starts = np.cumsum(counts) - counts
    return torch.from_numpy(np.stack([seq, np.arange(seq.size, dtype=np.int64) - starts[seq]], 1))


def max_graph_chunks(num_tokens: int, num_seqs: int, chunk_size: int = 64) -> int:
    """Most chunks `num_tokens` tokens can form in `num_seqs - 1` non-empty sequences (the last sequence of a
    graph bucket is always empty: it is where `padded_chunk_indices_host` points the padding). Each non-empty
    sequence of n tokens has ceil(n / chunk_size) <= (n + chunk_size - 1) / chunk_size chunks."""
    nonempty = max(0, min(num_seqs - 1, num_tokens))
    return (num_tokens + (chunk_size - 1) * nonempty) // chunk_size


def padded_chunk_indices_host(q_lens: list[int], num_rows: int, pad_seq: int, chunk_size: int = 64) -> torch.Tensor:
    """`chunk_indices_host(q_lens)` padded to `num_rows` rows with ``(pad_seq, 0)``; `pad_seq` must be an empty
    sequence (index >= len(q_lens), or q_lens[pad_seq] == 0) so the padding rows compute nothing."""
    assert pad_seq >= len(q_lens) or q_lens[pad_seq] == 0, f'padding sequence {pad_seq} is not empty'
    real = chunk_indices_host(q_lens, chunk_size)
    assert real.shape[0] <= num_rows, f'{real.shape[0]} chunks do not fit {num_rows} rows'
    out = np.zeros((num_rows, 2), dtype=np.int64)
    out[:real.shape[0]] = real.numpy()
    out[real.shape[0]:, 0] = pad_seq
    return torch.from_numpy(out)


def _run(fla_fn, q, k, v, g, beta, cu_seqlens, state, state_ids, is_fresh, use_qk_l2norm: bool,
         **fla_kwargs) -> torch.Tensor:
    check_shapes(q, k, v, g, beta, cu_seqlens, state, state_ids, is_fresh)
    init = _load_states(state, state_ids, is_fresh)
    if q.shape[0] == 0 or state_ids.numel() == 0:  # nothing to run: every sequence keeps its initial state
        _store_states(state, state_ids, init)
        return v.new_zeros(v.shape)
    # one dtype for q/k/v (fla's chunk path feeds them to tl.dot together); the decay stays float32
    q, k = q.to(v.dtype), k.to(v.dtype)
    o, final = fla_fn(q[None], k[None], v[None], g=g[None].float(), beta=beta[None], scale=q.shape[-1] ** -0.5,
                      initial_state=init, output_final_state=True, use_qk_l2norm_in_kernel=use_qk_l2norm,
                      cu_seqlens=cu_seqlens, **fla_kwargs)
    _store_states(state, state_ids, final)
    return o[0].to(v.dtype)


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    state: torch.Tensor,
    state_ids: torch.Tensor,
    is_fresh: torch.Tensor,
    use_qk_l2norm: bool = True,
    chunk_size: int = 64,
    chunk_indices: torch.Tensor | None = None,
    cu_seqlens_view: torch.Tensor | None = None,
) -> torch.Tensor:
    """Chunked (prefill) gated delta rule over packed varlen sequences via fla's `chunk_gated_delta_rule`.

    Shapes and state semantics as the default kernel. `chunk_size` is accepted for signature compatibility; the
    result does not depend on it and fla uses its own (64). `chunk_indices`: `chunk_indices_host` of the sequence
    lengths, on the device (None: fla derives them, synchronising once per new ``cu_seqlens``), or their padded
    form in a CUDA graph. `cu_seqlens_view`: the tensor object fla gets for ``cu_seqlens`` (the same buffer: a
    view of it), for a static buffer rewritten between forwards (see the module docstring). Returns
    ``[T, H, Dv]`` in ``v.dtype``.
    """
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk
    if cu_seqlens_view is not None:
        assert cu_seqlens_view.data_ptr() == cu_seqlens.data_ptr() and cu_seqlens_view.shape == cu_seqlens.shape, \
            'cu_seqlens_view must view the cu_seqlens buffer'
        cu_seqlens = cu_seqlens_view
    return _run(fla_chunk, q, k, v, g, beta, cu_seqlens, state, state_ids, is_fresh, use_qk_l2norm,
                chunk_indices=chunk_indices)


def recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    state: torch.Tensor,
    state_ids: torch.Tensor,
    is_fresh: torch.Tensor,
    use_qk_l2norm: bool = True,
    max_seqlen: int | None = None,
) -> torch.Tensor:
    """Token-by-token (decode) gated delta rule via fla's `fused_recurrent_gated_delta_rule`.

    Shapes and state semantics as the default kernel (`max_seqlen` is accepted for signature compatibility; fla
    never reads lengths back). Returns ``[T, H, Dv]`` in ``v.dtype``.
    """
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule as fla_recurrent
    return _run(fla_recurrent, q, k, v, g, beta, cu_seqlens, state, state_ids, is_fresh, use_qk_l2norm)
