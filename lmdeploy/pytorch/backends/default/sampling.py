"""Token sampling, in this order: logit bias, presence / frequency penalties, grammar mask, repetition penalty,
stop-id masking, temperature, min-p, top-k, top-p, seeded draws; logprobs are of the raw distribution."""
from __future__ import annotations

import torch

from ...model_inputs import SamplingInputs

# Every parameter `SamplingParams.validate` admits must sample without error: overflow to +inf (a tiny penalty or
# temperature dividing a logit) is clamped to the largest float32, so softmax never sees inf - inf.
_FLOAT32_MAX = torch.finfo(torch.float32).max


def _apply_openai_penalties(logits: torch.Tensor, inputs: SamplingInputs) -> None:
    """Logit bias; presence and frequency penalties over each row's generated tokens (in place)."""
    for row, pair in enumerate(inputs.logit_bias or ()):
        if pair is not None:
            logits[row].index_add_(0, pair[0], pair[1])
    for row, ids in enumerate(inputs.output_ids or ()):
        if ids is not None and ids.numel():
            counts = torch.bincount(ids, minlength=logits.size(-1)).to(logits.dtype)
            logits[row] -= inputs.frequency_penalty[row] * counts + inputs.presence_penalty[row] * (counts > 0)


def _filter_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    probs = logits.softmax(dim=-1)
    keep = probs >= min_p[:, None] * probs.max(dim=-1, keepdim=True).values
    return logits.masked_fill(~keep, float('-inf'))


def _apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """-inf for every token whose bit is 0 in its row of the int32 `bitmask` [S, ceil(V / 32)] (in place)."""
    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    allowed = ((bitmask[:, :, None] >> shifts) & 1).bool().flatten(1)[:, :logits.size(-1)]
    logits.masked_fill_(~allowed, float('-inf'))


def _apply_penalties(logits: torch.Tensor, inputs: SamplingInputs) -> torch.Tensor:
    _apply_openai_penalties(logits, inputs)
    if inputs.token_bitmask is not None:
        _apply_token_bitmask(logits, inputs.token_bitmask)
    for row, (ids, banned) in enumerate(zip(inputs.penalty_ids, inputs.banned_ids)):
        if ids is not None and ids.numel():
            penalty = inputs.repetition_penalty[row]
            scores = logits[row, ids]
            penalized = torch.where(scores > 0, scores / penalty, scores * penalty)
            logits[row, ids] = penalized.clamp(-_FLOAT32_MAX, _FLOAT32_MAX)
        if banned is not None and banned.numel():
            logits[row, banned] = float('-inf')
    return logits


def _filter_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    vocab = logits.size(-1)
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    remove = ranks >= k[:, None]
    probs = sorted_logits.softmax(dim=-1)
    # Keep the smallest prefix whose mass reaches top_p (the token crossing the threshold stays).
    remove |= (probs.cumsum(dim=-1) - probs) >= top_p[:, None]
    remove[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(remove, float('-inf'))
    return torch.empty_like(logits).scatter_(-1, sorted_idx, sorted_logits)


def _draw(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    if all(g is None for g in generators):
        return torch.multinomial(probs, 1).squeeze(-1)
    rows = [torch.multinomial(probs[i], 1, generator=g) for i, g in enumerate(generators)]
    return torch.cat(rows)


def _top_logprobs(raw_logits: torch.Tensor, next_ids: torch.Tensor, k: int) -> list[dict[int, float]]:
    logprobs = raw_logits.float().log_softmax(dim=-1)
    values, ids = logprobs.topk(k, dim=-1) if k > 0 else (logprobs[:, :0], next_ids[:, None][:, :0])
    chosen = logprobs.gather(-1, next_ids[:, None]).squeeze(-1)
    out = []
    for row in range(raw_logits.size(0)):
        entry = dict(zip(ids[row].tolist(), values[row].tolist()))
        entry[int(next_ids[row])] = float(chosen[row])
        out.append(entry)
    return out


def sample(logits: torch.Tensor, inputs: SamplingInputs) -> tuple[torch.Tensor, list[dict[int, float]] | None]:
    """Next token per row of `logits` [S, V], plus top logprobs of the raw distribution when asked."""
    raw = logits
    logits = _apply_penalties(logits.float().clone(), inputs)
    greedy_ids = logits.argmax(dim=-1)
    if inputs.all_greedy:
        next_ids = greedy_ids
    else:
        temperature = inputs.temperature.clamp(min=1e-5)[:, None]
        scaled = (logits / temperature).clamp(max=_FLOAT32_MAX)
        if inputs.min_p is not None:
            scaled = _filter_min_p(scaled, inputs.min_p)
        filtered = _filter_top_k_top_p(scaled, inputs.top_k, inputs.top_p)
        sampled = _draw(filtered.softmax(dim=-1), inputs.generators)
        next_ids = torch.where(inputs.temperature > 0, sampled, greedy_ids)
    logprobs = _top_logprobs(raw, next_ids, inputs.max_num_logprobs) if inputs.max_num_logprobs >= 0 else None
    return next_ids, logprobs
