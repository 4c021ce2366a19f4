"""Host inputs built per step in one pass over the batch: the sampling inputs (`make_sampling_inputs`, whose rows
`_stack` transposes into columns) against a field-by-field stack of `sampling_row`s written out here, and a feed's
rows and stop-id table (`build_feed`, one int64 table) and what `TokenFeed.apply` writes, against rows worked out by
hand."""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from lmdeploy.pytorch.engine.async_scheduling import LaunchedStep, build_feed
from lmdeploy.pytorch.engine.inputs_maker import make_sampling_inputs, sampling_row
from lmdeploy.pytorch.messages import SamplingParams, SchedulerSequence
from lmdeploy.pytorch.model_inputs import SamplingInputs
from lmdeploy.pytorch.paging.scheduler_output import SchedulerOutput


def _stack(rows) -> SamplingInputs:
    """The reference: each batch field built from the rows on its own."""
    temperature = [row.temperature for row in rows]
    penalties = any(row.output_ids is not None for row in rows)
    return SamplingInputs(
        temperature=torch.tensor(temperature, dtype=torch.float32),
        top_k=torch.tensor([row.top_k for row in rows], dtype=torch.int64),
        top_p=torch.tensor([row.top_p for row in rows], dtype=torch.float32),
        repetition_penalty=torch.tensor([row.repetition_penalty for row in rows], dtype=torch.float32),
        penalty_ids=[row.penalty_ids for row in rows], banned_ids=[row.banned_ids for row in rows],
        generators=[row.generator for row in rows],
        max_num_logprobs=max((row.logprobs for row in rows if row.logprobs is not None), default=-1),
        all_greedy=all(t == 0.0 for t in temperature),
        output_ids=[row.output_ids for row in rows] if penalties else None,
        presence_penalty=torch.tensor([row.presence_penalty for row in rows]) if penalties else None,
        frequency_penalty=torch.tensor([row.frequency_penalty for row in rows]) if penalties else None,
        min_p=torch.tensor([row.min_p for row in rows]) if any(row.min_p > 0 for row in rows) else None,
        logit_bias=[row.logit_bias for row in rows] if any(row.logit_bias is not None for row in rows) else None)


def _seq(seq_id: int, generated: int = 0, **params) -> SchedulerSequence:
    return SchedulerSequence(seq_id=seq_id, token_ids=[5, 6, 7] + [9] * generated, num_prompt_tokens=3,
                             sampling=SamplingParams(**params))


def _same(a, b) -> bool:
    """Tensors by dtype and value, lists and tuples item by item, anything else (generators, None) by identity or
    equality."""
    if isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a is b or a == b


def _assert_same(got, want) -> None:
    for f in dataclasses.fields(want):
        assert _same(getattr(got, f.name), getattr(want, f.name)), f.name


PLAIN = [dict(), dict(temperature=0.7, top_k=5), dict(temperature=1.3, top_p=0.8, random_seed=3),
         dict(temperature=0.5, top_k=1), dict(temperature=0.9, min_p=0.1, logprobs=4), dict(logprobs=2),
         dict(max_new_tokens=4, stop_token_ids=(1, 2), min_new_tokens=2)]  # past min_new_tokens: no banned ids


@pytest.mark.parametrize('rows', [PLAIN, PLAIN[:1], PLAIN[:4], [PLAIN[4], PLAIN[0]]], ids=['all', 'one', 'no-min-p',
                                                                                       'min-p-first'])
def test_plain_rows_build_what_the_field_by_field_stack_builds(rows):
    seqs = [_seq(i + 1, generated=2, **p) for i, p in enumerate(rows)]
    generators = {3: torch.Generator().manual_seed(3)}
    got, rejected = make_sampling_inputs(seqs, generators)
    assert not rejected
    _assert_same(got, _stack([sampling_row(seq, generators) for seq in seqs]))


@pytest.mark.parametrize('extra', [dict(repetition_penalty=1.2), dict(presence_penalty=0.5),
                                   dict(logit_bias=((4, 2.0),)), dict(stop_token_ids=(1,), min_new_tokens=5)],
                         ids=['repetition', 'presence', 'bias', 'banned'])
def test_a_row_with_per_row_tensors_gets_them_beside_plain_rows(extra):
    seqs = [_seq(1, generated=2), _seq(2, generated=2, temperature=0.8, **extra), _seq(3, generated=2, top_k=3)]
    got, _ = make_sampling_inputs(seqs, {})
    _assert_same(got, _stack([sampling_row(seq, {}) for seq in seqs]))
    per_row = [got.penalty_ids, got.banned_ids, got.output_ids or [None] * 3, got.logit_bias or [None] * 3]
    assert any(rows[1] is not None for rows in per_row) and all(rows[0] is None for rows in per_row)


def test_a_sampling_row_carries_each_parameter_in_its_own_field():
    gen = torch.Generator().manual_seed(1)
    seq = _seq(7, generated=2, temperature=0.7, top_k=5, top_p=0.8, repetition_penalty=1.1, logprobs=4,
               presence_penalty=0.3, frequency_penalty=-0.2, min_p=0.05, logit_bias=((4, 2.0),),
               stop_token_ids=(1, 2), min_new_tokens=3)
    row = sampling_row(seq, {7: gen})
    assert (row.temperature, row.top_k, row.top_p, row.repetition_penalty) == (0.7, 5, 0.8, 1.1)
    assert (row.logprobs, row.presence_penalty, row.frequency_penalty, row.min_p) == (4, 0.3, -0.2, 0.05)
    assert row.generator is gen and row.penalty_ids.tolist() == [5, 6, 7, 9] and row.banned_ids.tolist() == [1, 2]
    assert row.output_ids.tolist() == [9, 9] and row.logit_bias[0].tolist() == [4]
    assert row.logit_bias[1].tolist() == [2.0]
    assert sampling_row(_seq(8, temperature=0.7, top_k=1), {}).temperature == 0.0  # top_k 1 is greedy


def test_no_rows_build_empty_columns():
    got, _ = make_sampling_inputs([], {})
    _assert_same(got, _stack([]))


def _decoding(seq_id: int, generated: int, pending: int, **params) -> SchedulerSequence:
    """A sequence 3 prompt tokens + `generated` long, all computed, with `pending` tokens in flight."""
    seq = _seq(seq_id, generated=generated, **params)
    seq.num_computed, seq.num_pending = seq.num_tokens, pending
    return seq


def test_feed_rows_and_stop_mask_match_each_row_worked_out_by_hand():
    # Batch rows: 0 a prefill chunk of 4 tokens (no pending token), then three decodes feeding a pending token.
    chunk = _seq(1)
    a = _decoding(2, generated=1, pending=1, stop_token_ids=(7,))                 # 1 + 1 > 0 - 1: may stop
    b = _decoding(3, generated=0, pending=1)                                      # no stop ids
    c = _decoding(4, generated=0, pending=1, stop_token_ids=(3, 4, 5), min_new_tokens=2)  # 0 + 1 > 1 is false
    sched = SchedulerOutput(seqs=[chunk, a, b, c], num_new_tokens=[4, 1, 1, 1])
    prev_sampled = [c, b, a]  # the forward in flight sampled them in this row order: ids 3, 9, 7
    prev = LaunchedStep(SchedulerOutput(), prev_sampled,
                        SimpleNamespace(sampled_ids=SimpleNamespace(device_ids=torch.tensor([3, 9, 7]))), [], [],
                        True)
    feed = build_feed(sched, [a, c], prev)  # this forward samples a and c (logit rows 0 and 1)
    assert feed.token_rows.tolist() == [4, 5, 6] and feed.src_rows.tolist() == [2, 1, 0]
    assert feed.batch_rows.tolist() == [1, 2, 3] and feed.logit_rows.tolist() == [0, -1, 1]
    assert feed.stop_ids.tolist() == [[7, -1, -1], [-1, -1, -1], [3, 4, 5]]
    assert feed.can_stop.tolist() == [True, True, False]
    inputs = SimpleNamespace(input_ids=torch.zeros(7, dtype=torch.int64), state_ids=torch.tensor([11, 12, 13, 14]))
    stopped = feed.apply(inputs)
    assert inputs.input_ids.tolist() == [0, 0, 0, 0, 7, 9, 3]
    # a fed its stop id 7 (state row -> dummy 0); c fed 3, a stop id, but still under min_new_tokens
    assert stopped.tolist() == [True, False, False] and inputs.state_ids.tolist() == [11, 0, 13, 14]
    moved = feed.to(torch.device('cpu'))
    assert moved.source is feed.source and torch.equal(moved.table, feed.table) and feed.tensors() == [feed.table]


def test_a_feed_without_stop_ids_has_no_stop_mask():
    seq = _decoding(1, generated=1, pending=1)
    prev = LaunchedStep(SchedulerOutput(), [seq], SimpleNamespace(sampled_ids=SimpleNamespace(
        device_ids=torch.tensor([5]))), [], [], True)
    feed = build_feed(SchedulerOutput(seqs=[seq], num_new_tokens=[1]), [seq], prev)
    assert feed.stop_ids is None and feed.can_stop is None
    inputs = SimpleNamespace(input_ids=torch.zeros(1, dtype=torch.int64), state_ids=torch.tensor([3]))
    assert feed.apply(inputs) is None and inputs.input_ids.tolist() == [5] and inputs.state_ids.tolist() == [3]
