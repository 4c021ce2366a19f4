"""Grammar-constrained sampling: each constrained sequence's matcher, and the allowed-token bitmask of a batch.

Runs on the engine thread inside `make_sampling_inputs`, before every sampling of the sequence. A matcher first
consumes the tokens generated since its last call (so no hook after sampling is needed, and a recomputed or
repeated build consumes nothing twice), then fills its row of the bitmask. Rows without a grammar are all ones;
a batch without any grammar builds no bitmask at all. A token the grammar refuses (only possible if something
bypassed the mask) ends the constraint: the row then allows only stop tokens.
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
        if state.failed:
            bitmask[i] = 0
            for token in state.matcher.stop_token_ids:
                bit = 1 << (token % 32)
                bitmask[i, token // 32] |= bit - (1 << 32) if bit >= 1 << 31 else bit  # int32 two's complement
        else:
            state.matcher.fill_next_token_bitmask(bitmask, i)
    return bitmask
