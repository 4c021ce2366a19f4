"""Pure-torch causal depthwise conv1d with a per-sequence input history (reference / default backend)."""

import torch
import torch.nn.functional as F


def _load_history(conv_state: torch.Tensor, state_ids: torch.Tensor, is_fresh: torch.Tensor) -> torch.Tensor:
    """Gather float32 histories ``[B, C, K-1]``; fresh rows are zero whatever the slot holds (NaN-safe)."""
    hist = conv_state[state_ids].float()
    fresh = is_fresh.to(device=hist.device, dtype=torch.bool)[:, None, None]
    return torch.where(fresh, torch.zeros_like(hist), hist)


def _extended_layout(cu_seqlens: torch.Tensor, num_tokens: int, hist_len: int) -> tuple[torch.Tensor, ...]:
    """Positions in the packed ``[hist_0, x_0, hist_1, x_1, ...]`` sequence (length ``T + B * (K-1)``).

    Returns ``(token_pos [T], seq_start [B], seq_end [B])``: where each token lands, where each sequence's history
    begins, and one past its last input (so its final K-1 inputs are ``seq_end - (K-1) .. seq_end - 1``).
    """
    device = cu_seqlens.device
    token_ids = torch.arange(num_tokens, device=device)
    seq_of_token = torch.searchsorted(cu_seqlens[1:], token_ids, right=True)
    token_pos = token_ids + (seq_of_token + 1) * hist_len
    seq_idx = torch.arange(cu_seqlens.numel() - 1, device=device)
    seq_start = cu_seqlens[:-1] + seq_idx * hist_len
    seq_end = cu_seqlens[1:] + (seq_idx + 1) * hist_len
    return token_pos, seq_start, seq_end


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    state_ids: torch.Tensor,
    is_fresh: torch.Tensor,
    cu_seqlens: torch.Tensor,
    activation: str | None = 'silu',
) -> torch.Tensor:
    """Causal depthwise conv over packed varlen sequences, continuing from a stored input history.

    Shapes: x ``[T, C]``; weight ``[C, K]``; bias ``[C]`` or None; conv_state pool ``[num_slots, C, K-1]`` (may be
    strided in dim 0; only indexed); state_ids int64 ``[B]`` (distinct); is_fresh bool ``[B]``; cu_seqlens int64
    ``[B+1]``.

    With ``xx_b = [hist_b, x_b]`` (hist_b = zeros if fresh else ``conv_state[state_ids[b]]``, oldest first),
    ``y[t] = act(bias + sum_j weight[:, j] * xx_b[t + j])`` for the t-th token of sequence b, i.e. Qwen3-Next's
    ``nn.Conv1d(groups=C, padding=K-1)[..., :L]`` started from the history instead of zeros. Afterwards
    ``conv_state[state_ids[b]]`` holds the last K-1 columns of ``xx_b`` (so short segments keep the older part of
    their history; zero-length segments keep it unchanged, or zero it if fresh). Sequences never see each other.
    Math in float32; returns ``[T, C]`` in ``x.dtype``.
    """
    if activation not in (None, 'silu'):
        raise ValueError(f'unsupported activation: {activation}')
    num_tokens, channels = x.shape
    hist_len = weight.shape[-1] - 1
    hist = _load_history(conv_state, state_ids, is_fresh)
    token_pos, seq_start, seq_end = _extended_layout(cu_seqlens, num_tokens, hist_len)
    offsets = torch.arange(hist_len, device=x.device)

    hist_pos = seq_start[:, None] + offsets  # [B, K-1]
    ext = x.new_zeros(num_tokens + hist.shape[0] * hist_len, channels, dtype=torch.float32)
    ext[hist_pos.flatten()] = hist.transpose(1, 2).reshape(-1, channels)
    ext[token_pos] = x.float()

    new_state = ext[seq_end[:, None] - hist_len + offsets]  # [B, K-1, C]: last K-1 columns of [hist, x]
    if state_ids.numel() > 0:
        conv_state[state_ids] = new_state.transpose(1, 2).to(conv_state.dtype)

    if num_tokens == 0:
        return x.new_zeros(0, channels)
    # conv output o covers ext[o : o + K]; token at ext position p is the last element of window p - (K - 1)
    y = F.conv1d(ext.t().unsqueeze(0), weight.float().unsqueeze(1), None if bias is None else bias.float(),
                 groups=channels)[0].t()
    y = y[token_pos - hist_len]
    if activation == 'silu':
        y = F.silu(y)
    return y.to(x.dtype)
