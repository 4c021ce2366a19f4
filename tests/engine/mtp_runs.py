"""What the MTP engine tests share (`test_mtp_engine.py`, `test_mtp_graphs.py`): the tiny hybrid checkpoints (random
`mtp.*` weights come from `mtp_reference.py`), one engine factory, prompts, greedy sampling, a driver that checks
integrity after every step, draft overrides (a recorder, forced acceptance), the forced-acceptance state check, the
resume at a reply checkpoint and the pool accounting after aborts.

Plain decoding of the same engine is the reference (itself tested against transformers elsewhere). Engines run in
float32 on every device, so plain and speculative argmaxes never part on a tie.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from engines import engine_factory

from lmdeploy import SpeculativeConfig
from lmdeploy.pytorch.messages import SamplingParams

LIN, FULL = 'linear_attention', 'full_attention'
K = 3
BLOCK = 16
ATOL = 2e-4
make_engine = engine_factory(block_size=BLOCK, kernel_block_size=8, num_gpu_blocks=96, max_batch_size=4,
                             max_prefill_token_num=256, dtype='float32')
MODELS = {
    'qwen3_5': ('qwen3_5', dict(num_hidden_layers=3, layer_types=[LIN, FULL, LIN])),
    'qwen3_next': ('qwen3_next', dict(num_hidden_layers=2, layer_types=[LIN, FULL], mlp_only_layers=[1])),
}


def on_device(device: str, **overrides) -> dict:
    """Engine overrides for `device` (plus `overrides`)."""
    return {'device_type': device, **overrides}


def mtp_spec(k: int = K) -> SpeculativeConfig:
    return SpeculativeConfig(method='mtp', num_speculative_tokens=k)


def random_prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0.0)


def run_to_idle(engine, prompts, sampling, collect=False, after_step=None):
    """Drive the engine to idle (integrity after every step); returns each request's tokens (and logits).
    `sampling`: one `SamplingParams` for every prompt, or a list of one per prompt."""
    tokens = {}
    samplings = sampling if isinstance(sampling, list) else [sampling] * len(prompts)
    ids = [engine.add_request(p, s, collect_logits=collect,
                              callback=lambda o: tokens.setdefault(o.seq_id, []).extend(o.new_token_ids))
           for p, s in zip(prompts, samplings)]
    while engine.has_work:
        engine.step()
        engine.check_integrity()
        if after_step is not None:
            after_step(engine)
    out = [tokens.get(i, []) for i in ids]
    if collect:
        return out, [engine.pop_collected_logits(i) for i in ids]
    return out


def record_hits(hits: list[int]) -> Callable:
    """An `after_step` that appends every live request's `num_cached` to `hits`."""
    return lambda engine: hits.extend(seq.num_cached for seq, _ in engine._seqs.values())


def state_rows(engine, slot: int) -> list[torch.Tensor]:
    """Copies of every state-pool row of `slot` (each layer's recurrent and conv state)."""
    return [view[slot].clone() for layer in engine.cache_engine.state_caches for view in layer.values()]


class DraftRecorder:
    """A draft override that keeps the head's proposals and records them by (prompt start, sequence length)."""

    def __init__(self):
        self.proposals: dict[tuple, list[int]] = {}

    def __call__(self, seq, drafts):
        self.proposals[(tuple(seq.token_ids[:4]), seq.num_tokens)] = list(drafts)
        return drafts


def drafts_wrong_at(full_of: Callable, schedule: Iterator[int]) -> Callable:
    """A draft override proposing the sequence's known continuation (`full_of(seq)`, padded past its end), wrong at
    draft `next(schedule)` (K: all right), so that exactly that many drafts are accepted."""
    def replay(seq, _):
        t, j = seq.num_tokens, next(schedule)
        drafts = full_of(seq)[t:t + K]
        if j < K:
            drafts[j] = (drafts[j] + 1) % 500
        return drafts
    return replay


def forced_acceptance_states(path: str, prepare: Callable = lambda engine: None) -> tuple[int, object]:
    """Forced acceptance of every count 0 .. K on one prompt: the speculative tokens are plain greedy's, and after
    every step the recurrent state equals plain decoding's at the same position. `prepare(engine)` runs on the
    speculative engine before its first request. Returns (states compared, what `prepare` returned)."""
    prompt, steps = random_prompt(23, 6), 24
    plain_states = {}

    def keep_plain(engine):
        for seq, _ in engine._seqs.values():
            if seq.state_slot is not None:
                plain_states[seq.num_computed] = state_rows(engine, seq.state_slot)

    (cont,) = run_to_idle(make_engine(path), [prompt], greedy(steps), after_step=keep_plain)
    full = prompt + cont + [0] * (2 * K)
    engine = make_engine(path, speculative_config=mtp_spec())
    prepared = prepare(engine)
    # accepted drafts per step: every count 0 .. K
    engine.speculative.set_draft_override(drafts_wrong_at(lambda seq: full, iter([0, 1, 2, 3, 3, 2, 1, 0] * 4)))
    advances = []

    def check_state(engine):
        for seq, _ in engine._seqs.values():
            if seq.state_slot is None or seq.num_computed not in plain_states:
                continue
            # The verification forward sums the K + 1 tokens in another order than one-token steps: on some CPUs
            # (float32, states up to ~2.4 here) that leaves ~1.1e-5 after 24 steps, about 5e-6 of the largest
            # state; a state not rolled back, or one restored from the wrong step, is off by orders more.
            for got, want in zip(state_rows(engine, seq.state_slot), plain_states[seq.num_computed]):
                torch.testing.assert_close(got, want, atol=4e-5, rtol=1e-5)
            advances.append(seq.num_computed)

    (spec,) = run_to_idle(engine, [prompt], greedy(steps), after_step=check_state)
    assert spec == cont
    accepted = {b - a - 1 for a, b in zip(advances, advances[1:]) if a >= len(prompt)}
    assert accepted == set(range(K + 1)), accepted
    return len(advances), prepared


def check_resume_at_reply_checkpoint(engine, cold, first: list[int], reply: list[int], tol: float) -> None:
    """A request extending `first` and its `reply` (but the reply's last token) resumes at `first`'s reply
    checkpoint in `engine` (past the prompt): its tokens and logits equal those of the `cold` engine."""
    third = first + reply[:-1] + random_prompt(3, 9)
    want, (want_logits,) = run_to_idle(cold, [third], greedy(6), collect=True)
    hits = []
    got, (got_logits,) = run_to_idle(engine, [third], greedy(6), collect=True, after_step=record_hits(hits))
    assert got == want and hits and hits[0] > len(first)
    torch.testing.assert_close(got_logits, want_logits[hits[0]:], atol=tol, rtol=tol)


def num_free(engine) -> tuple[int, int]:
    """(free KV blocks, free state slots)."""
    return engine.scheduler.block_manager.num_free, engine.scheduler.state_manager.num_free


def assert_pools_returned(engine, free: tuple[int, int]) -> None:
    """Every block and state slot counted in `free` (`num_free` before the requests) is free again or the trie's."""
    trie_blocks, trie_slots = engine.scheduler.prefix_cache.owners()
    assert engine.scheduler.block_manager.num_free + sum(1 for _ in trie_blocks) == free[0]
    assert engine.scheduler.state_manager.num_free + len(trie_slots) == free[1]
