"""Appending a sampled token to a sequence and deciding whether it stops (`Scheduler.update` calls it per row).

Mutates only the sequence's token ids and logprobs; never its blocks, slot or status (the scheduler finishes a
stopped sequence in `release`, after its reply checkpoint).
"""
from __future__ import annotations

from .scheduler_output import SampledToken, SequenceUpdate


def append_sampled(row: SampledToken, session_len: int) -> SequenceUpdate:
    """Append `row`'s token; a stop token (after `min_new_tokens`) or a stop sequence stops with 'stop', the token
    budget or the session length with 'length'. A stop token is not sent to the client."""
    seq, token, logprobs = row
    params = seq.sampling
    seq.token_ids.append(token)
    if params.logprobs is not None and logprobs is not None:
        seq.logprobs.append(logprobs)
    reason = None
    if token in params.stop_token_ids and seq.num_generated > params.min_new_tokens - 1:
        reason = 'stop'
    elif any(len(s) <= seq.num_generated and tuple(seq.token_ids[-len(s):]) == s for s in params.stop_sequences):
        reason = 'stop'
    elif seq.num_generated >= params.max_new_tokens or seq.num_tokens >= session_len:
        reason = 'length'
    new_ids = [] if reason == 'stop' and token in params.stop_token_ids else [token]
    kept = [logprobs] if params.logprobs is not None and logprobs and new_ids else None
    return SequenceUpdate(seq, new_ids, kept, reason)
