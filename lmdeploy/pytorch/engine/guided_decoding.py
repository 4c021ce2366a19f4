"""Grammar-constrained sampling: each constrained sequence's matcher, and the allowed-token bitmask of a batch.

Runs on the engine thread inside `make_sampling_inputs`, before every sampling of the sequence. A matcher first
consumes the tokens generated since its last call (so no hook after sampling is needed, and a recomputed or
repeated build consumes nothing twice), then fills its row of the bitmask. Rows without a grammar are all ones;
a batch without any grammar builds no bitmask at all. A token the grammar refuses (only possible if something
bypassed the mask) ends the constraint: the row then allows only stop tokens. So does a grammar that has ended
(its matcher accepted a stop token) while the request goes on, as `ignore_eos` makes it: the output past the
grammar's end is stop tokens only, so its text still matches the grammar. Where the request may not stop yet
(`min_new_tokens` bans its stop tokens until then) and its grammar allows nothing but stopping, the constraint ends
too and the row allows every token until the request may stop, as vLLM does past a grammar's end: nothing else
could be sampled.
"""
from __future__ import annotations

import logging

import torch

from ..messages import SchedulerSequence

logger = logging.getLogger('lmdeploy')


class GrammarState:
    """One sequence's matcher and how many generated tokens it has consumed."""

    __slots__ = ('matcher', 'num_consumed', 'failed')

    def __init__(self, grammar):
        import xgrammar as xgr
        self.matcher = xgr.GrammarMatcher(grammar)
        self.num_consumed = 0
        self.failed = False

    def catch_up(self, seq: SchedulerSequence) -> None:
        generated = seq.token_ids[seq.num_prompt_tokens:]
        for token in generated[self.num_consumed:]:
            if not self.failed and not self.matcher.is_terminated() and not self.matcher.accept_token(token):
                logger.warning('request %d: token %d breaks its grammar; only stop tokens are allowed now',
                               seq.seq_id, token)
                self.failed = True
        self.num_consumed = len(generated)


def _bit(token: int) -> int:
    """The token's bit in its int32 word of a bitmask row (two's complement for bit 31)."""
    bit = 1 << (token % 32)
    return bit - (1 << 32) if bit >= 1 << 31 else bit


def _allows_other_than(row: torch.Tensor, tokens: list[int]) -> bool:
    """Whether the bitmask row allows a token outside `tokens`."""
    rest = row.clone()
    for token in tokens:
        if token // 32 < rest.numel():
            rest[token // 32] &= ~_bit(token)
    return bool(rest.any())


def grammar_bitmask(seqs: list[SchedulerSequence]) -> torch.Tensor | None:
    """[len(seqs), ceil(vocab / 32)] int32 bitmask of allowed tokens, or None when no sequence has a grammar."""
    rows = [i for i, seq in enumerate(seqs) if seq.sampling.grammar is not None]
    if not rows:
        return None
    import xgrammar as xgr
    vocab = seqs[rows[0]].sampling.grammar.tokenizer_info.vocab_size
    bitmask = xgr.allocate_token_bitmask(len(seqs), vocab)
    for i in rows:
        seq = seqs[i]
        if seq.grammar_state is None:
            seq.grammar_state = GrammarState(seq.sampling.grammar)
        state: GrammarState = seq.grammar_state
        state.catch_up(seq)
        params = seq.sampling
        stop_banned = bool(params.min_new_tokens and params.stop_token_ids
                           and seq.num_generated + seq.num_pending < params.min_new_tokens)
        if not state.failed and not state.matcher.is_terminated():
            state.matcher.fill_next_token_bitmask(bitmask, i)
            if not stop_banned or _allows_other_than(bitmask[i], params.stop_token_ids):
                continue
            state.failed = True  # the grammar could only end here, and the request may not yet
        if stop_banned:
            bitmask[i] = -1  # every bit set: the row is free until the request may stop
            continue
        bitmask[i] = 0
        for token in state.matcher.stop_token_ids:
            bitmask[i, token // 32] |= _bit(token)
    return bitmask
