"""Appending a sampled token to a sequence and deciding whether it stops (`Scheduler.update` calls it per row).

Mutates only the sequence's token ids and logprobs; never its blocks, slot or status (the scheduler finishes a
stopped sequence in `release`, after its reply checkpoint).
"""
from __future__ import annotations

from .scheduler_output import SampledToken, SequenceUpdate


def append_sampled(row: SampledToken, session_len: int) -> SequenceUpdate:
    """Append `row`'s token; a stop token (after `min_new_tokens`) or a stop sequence stops with 'stop', the token
    budget or the session length with 'length'. A stop token is not sent to the client."""
    seq, token, logprobs = row.seq, row.token_id, row.logprobs
    params = seq.sampling
    seq.token_ids.append(token)
    if params.logprobs is not None and logprobs is not None:
        seq.logprobs.append(logprobs)
    reason = None
    num_generated = seq.num_generated
    is_stop_id = token in params.stop_token_ids
    if is_stop_id and num_generated > params.min_new_tokens - 1:
        reason = 'stop'
    elif params.stop_sequences and any(len(s) <= num_generated and tuple(seq.token_ids[-len(s):]) == s
                                       for s in params.stop_sequences):
        reason = 'stop'
    elif num_generated >= params.max_new_tokens or seq.num_tokens >= session_len:
        reason = 'length'
    new_ids = [] if reason == 'stop' and is_stop_id else [token]
    kept = [logprobs] if params.logprobs is not None and logprobs and new_ids else None
    return SequenceUpdate(seq, new_ids, kept, reason)


def append_run(row: SampledToken, session_len: int) -> tuple[SequenceUpdate, int]:
    """Append a verified run (`row.accepted` drafts, then `row.token_id`) token by token, exactly as plain decoding
    would append them one step at a time: the first stop ends the run and the tokens after it are dropped. Returns
    the merged update and how many tokens were appended (1 .. len(accepted) + 1), which is also how many of the
    verify forward's fed tokens become committed."""
    tokens = [*row.accepted, row.token_id]
    new_ids: list[int] = []
    logprobs: list[dict[int, float]] | None = None
    per_token = [*row.accepted_logprobs, row.logprobs] if row.accepted_logprobs else [None] * len(row.accepted) + \
        [row.logprobs]
    for i, token in enumerate(tokens):
        update = append_sampled(SampledToken(row.seq, token, per_token[i]), session_len)
        new_ids += update.new_token_ids
        if update.logprobs:
            logprobs = (logprobs or []) + update.logprobs
        if update.finish_reason is not None:
            return SequenceUpdate(row.seq, new_ids, logprobs, update.finish_reason), i + 1
    return SequenceUpdate(row.seq, new_ids, logprobs, None), len(tokens)
