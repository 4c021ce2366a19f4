"""Pure-torch gated delta rule kernels (reference / default backend).

Layout shared by both entry points (packed varlen, ``T`` tokens of ``B`` sequences):

* ``q, k``: ``[T, Hk, Dk]``; ``v``: ``[T, H, Dv]``; ``g``, ``beta``: ``[T, H]``.
  ``g`` is the log-space decay (the state is multiplied by ``exp(g)`` per step, so ``g <= 0``);
  ``beta`` is already sigmoid-ed. ``H`` must be a multiple of ``Hk``; value head ``h`` reads key head
  ``h // (H // Hk)`` (grouped value attention, as in transformers' Qwen3-Next).
* ``cu_seqlens``: int64 ``[B + 1]``; sequence ``b`` owns tokens ``cu_seqlens[b]:cu_seqlens[b + 1]``.
* ``state``: pool ``[num_slots, H, Dk, Dv]``; may be strided in dim 0, so it is only ever indexed, never viewed.
* ``state_ids``: int64 ``[B]`` slot of each sequence (distinct); ``is_fresh``: bool ``[B]``.

Invariants: a fresh sequence starts from a zero state and its slot's stale contents never reach the
result (they are discarded with ``torch.where``, so NaN garbage cannot leak); a non-fresh one starts from
``state[state_ids[b]]``. On return ``state[state_ids[b]]`` holds the final state of every sequence, cast to
the pool dtype (a zero-length sequence therefore writes its initial state back: zeros if fresh, else
unchanged). Slots not named in ``state_ids`` are untouched. Math is done in float32; outputs have ``v``'s dtype.

Semantics follow ``torch_chunk_gated_delta_rule`` / ``torch_recurrent_gated_delta_rule`` of
``transformers.models.qwen3_next``: optional l2norm of q and k with ``x * rsqrt(sum(x^2) + 1e-6)``, then
q scaled by ``Dk ** -0.5``; per token ``S = exp(g) S; S += k (beta (v - k^T S))^T; o = S^T q``.
"""

import torch
import torch.nn.functional as F

_L2NORM_EPS = 1e-6


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    """FLA/transformers l2norm: eps is added to the squared norm, not clamped on the norm."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + _L2NORM_EPS)


def _prepare_inputs(q, k, v, g, beta, use_qk_l2norm: bool) -> tuple[torch.Tensor, ...]:
    """Cast to float32, normalise/scale q and k, and expand key heads to the value heads."""
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    if use_qk_l2norm:
        q, k = _l2norm(q), _l2norm(k)
    q = q * q.shape[-1] ** -0.5
    num_heads, num_k_heads = v.shape[1], k.shape[1]
    if num_heads != num_k_heads:
        assert num_heads % num_k_heads == 0, f'value heads {num_heads} not a multiple of key heads {num_k_heads}'
        q = q.repeat_interleave(num_heads // num_k_heads, dim=1)
        k = k.repeat_interleave(num_heads // num_k_heads, dim=1)
    return q, k, v, g, beta


def _load_states(state: torch.Tensor, state_ids: torch.Tensor, is_fresh: torch.Tensor) -> torch.Tensor:
    """Gather float32 initial states ``[B, ...]``; fresh rows are zero whatever the slot holds."""
    init = state[state_ids].float()
    fresh = is_fresh.to(device=init.device, dtype=torch.bool).view(-1, *([1] * (init.dim() - 1)))
    return torch.where(fresh, torch.zeros_like(init), init)


def _store_states(state: torch.Tensor, state_ids: torch.Tensor, final: torch.Tensor) -> None:
    """Scatter final states into the pool in place (index_put, so strided pools are fine)."""
    if state_ids.numel() > 0:
        state[state_ids] = final.to(state.dtype)


def _chunk_sequence(q, k, v, g, beta, s, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked gated delta rule for one sequence.

    Inputs are float32 and head-major: q, k ``[H, L, Dk]``, v ``[H, L, Dv]``, g, beta ``[H, L]``, s ``[H, Dk, Dv]``.
    The tail is zero-padded to a whole chunk; padded steps have ``g = 0`` (no decay), ``k = v = beta = 0``
    (no write), so they leave the state unchanged. Returns ``(o [H, L, Dv], final state [H, Dk, Dv])``.
    """
    num_heads, seqlen, _ = k.shape
    dim_v = v.shape[-1]
    pad = (-seqlen) % chunk_size
    num_chunks = (seqlen + pad) // chunk_size

    def chunked(x: torch.Tensor) -> torch.Tensor:
        x = F.pad(x, (0, 0, 0, pad)) if x.dim() == 3 else F.pad(x, (0, pad))
        return x.reshape(num_heads, num_chunks, chunk_size, *x.shape[2:])

    q, k, v, g, beta = (chunked(x) for x in (q, k, v, g, beta))
    g_cum = g.cumsum(-1)  # [H, N, C]: log of the decay from the chunk start to position i (inclusive)
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    # decay[i, j] = exp(g_cum[i] - g_cum[j]) for j <= i, else 0 (masked before exp to avoid overflow)
    decay = (g_cum.unsqueeze(-1) - g_cum.unsqueeze(-2)).masked_fill(~causal, float('-inf')).exp()

    k_beta = k * beta.unsqueeze(-1)
    # UT transform: solve (I + A) X = rhs with A strictly lower triangular; unitriangular ignores the diagonal.
    a_mat = (k_beta @ k.transpose(-1, -2) * decay).tril(-1)
    rhs = torch.cat([v * beta.unsqueeze(-1), k_beta * g_cum.exp().unsqueeze(-1)], dim=-1)
    u, w = torch.linalg.solve_triangular(a_mat, rhs, upper=False, unitriangular=True).split([dim_v, k.shape[-1]], -1)

    intra = q @ k.transpose(-1, -2) * decay  # causal incl. diagonal
    q_decayed = q * g_cum.exp().unsqueeze(-1)
    k_to_end = k * (g_cum[..., -1:] - g_cum).exp().unsqueeze(-1)
    chunk_decay = g_cum[..., -1].exp()[..., None, None]  # [H, N, 1, 1]

    out = []
    for i in range(num_chunks):
        v_new = u[:, i] - w[:, i] @ s
        out.append(q_decayed[:, i] @ s + intra[:, i] @ v_new)
        s = s * chunk_decay[:, i] + k_to_end[:, i].transpose(-1, -2) @ v_new
    o = torch.stack(out, dim=1).reshape(num_heads, -1, dim_v)[:, :seqlen]
    return o, s


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
    seq_bounds: list[int] | None = None,
) -> torch.Tensor:
    """Chunked (prefill) gated delta rule over packed varlen sequences; see the module docstring.

    Loops over sequences and over chunks within a sequence; everything inside a chunk is batched over heads.
    ``seq_bounds`` (host ints, ``cu_seqlens`` on the host) avoids reading the bounds back from the device.
    Returns ``[T, H, Dv]`` in ``v.dtype`` and updates ``state`` in place.
    """
    q, k, vf, g, beta = _prepare_inputs(q, k, v, g, beta, use_qk_l2norm)
    states = _load_states(state, state_ids, is_fresh)
    out = torch.zeros_like(vf)
    bounds = cu_seqlens.tolist() if seq_bounds is None else seq_bounds
    finals = []
    for b in range(len(bounds) - 1):
        bos, eos = bounds[b], bounds[b + 1]
        s = states[b]
        if eos > bos:
            seq = (x[bos:eos].transpose(0, 1) for x in (q, k, vf, g, beta))
            o, s = _chunk_sequence(*seq, s, chunk_size)
            out[bos:eos] = o.transpose(0, 1)
        finals.append(s)
    if finals:
        _store_states(state, state_ids, torch.stack(finals))
    return out.to(v.dtype)


def _recurrent_step(s, q, k, v, g, beta) -> tuple[torch.Tensor, torch.Tensor]:
    """One token for a batch of states.

    s ``[B, H, Dk, Dv]``; q, k ``[B, H, Dk]``; v ``[B, H, Dv]``; g, beta ``[B, H]``. Returns ``(o [B, H, Dv], s)``.
    """
    s = s * g.exp()[..., None, None]
    k_s = (k.unsqueeze(-2) @ s).squeeze(-2)  # k^T S: what the state currently predicts for k
    delta = (v - k_s) * beta.unsqueeze(-1)
    s = s + k.unsqueeze(-1) * delta.unsqueeze(-2)
    o = (q.unsqueeze(-2) @ s).squeeze(-2)
    return o, s


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
    """Token-by-token (decode) gated delta rule over packed varlen sequences; see the module docstring.

    Step ``t`` advances every sequence longer than ``t`` at once (batched over sequences), so a decode batch of
    single tokens is one step. ``max_seqlen`` (host int, >= every length) avoids reading the lengths back from the
    device, which a CUDA graph capture forbids. Returns ``[T, H, Dv]`` in ``v.dtype`` and updates ``state`` in place.
    """
    q, k, vf, g, beta = _prepare_inputs(q, k, v, g, beta, use_qk_l2norm)
    s = _load_states(state, state_ids, is_fresh)
    num_tokens = vf.shape[0]
    out = vf.new_zeros(num_tokens + 1, *vf.shape[1:])  # last row absorbs writes of finished sequences
    starts = cu_seqlens[:-1]
    seqlens = cu_seqlens[1:] - starts
    if max_seqlen is not None:
        max_len = max_seqlen
    else:
        max_len = int(seqlens.max()) if seqlens.numel() > 0 else 0
    for t in range(max_len):
        active = seqlens > t
        pos = starts + t
        gather = pos.clamp(max=num_tokens - 1)
        o, s_new = _recurrent_step(s, q[gather], k[gather], vf[gather], g[gather], beta[gather])
        s = torch.where(active[:, None, None, None], s_new, s)
        out[torch.where(active, pos, num_tokens)] = o
    _store_states(state, state_ids, s)
    return out[:num_tokens].to(v.dtype)
