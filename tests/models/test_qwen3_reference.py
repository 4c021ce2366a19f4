"""Qwen3 engine outputs against transformers' `Qwen3ForCausalLM` on tiny random-weight checkpoints.

Every engine run is driven step by step with `check_integrity()` after each step, and must end with the whole KV
pool back on the free list. The reference is transformers' forward over the full token sequence (teacher forcing)
and a hand-written greedy loop with explicit `position_ids`.
"""
from __future__ import annotations

from typing import NamedTuple

import pytest
import torch
import transformers
from engines import engine_factory
from numeric import assert_close

from lmdeploy.pytorch.engine.engine import Engine
from lmdeploy.pytorch.messages import SamplingParams

# Checkpoint shapes (config overrides of the 2-layer, hidden-64 test model).
SHAPES = {
    'gqa-q4-kv2': {},
    'mha-q4-kv4': {'num_key_value_heads': 4},
    'tied-embeddings': {'tie_word_embeddings': True},
    'head_dim32-hidden64-q4': {'head_dim': 32},
}
PROMPT_LENS = (1, 7, 33, 65)
NUM_NEW_TOKENS = 8
LOGITS_TOL = 1e-4
# Greedy tokens must match wherever the reference's top-2 logit gap exceeds this (two logits each off by the
# logits tolerance can swap only below it).
GAP_TOL = 2 * LOGITS_TOL


class Reference(NamedTuple):
    prompt: list[int]
    # transformers' greedy continuation of `prompt` (no eos).
    generated: list[int]
    # transformers' logits over prompt + generated, [len(prompt) + len(generated), vocab].
    logits: torch.Tensor


class EngineResult(NamedTuple):
    tokens: list[int]
    # Logits of every fed token: prompt + tokens[:-1].
    logits: torch.Tensor
    finish_reason: str | None


def _prompt(length: int, vocab_size: int, seed: int = 0) -> list[int]:
    gen = torch.Generator().manual_seed(1000 * seed + length)
    return torch.randint(0, vocab_size, (length,), generator=gen).tolist()


@torch.no_grad()
def _hf_logits(model, token_ids: list[int]) -> torch.Tensor:
    input_ids = torch.tensor([token_ids])
    position_ids = torch.arange(len(token_ids))[None]
    return model(input_ids=input_ids, position_ids=position_ids).logits[0].float()


@torch.no_grad()
def _hf_greedy(model, prompt: list[int], num_new_tokens: int) -> list[int]:
    ids = list(prompt)
    for _ in range(num_new_tokens):
        ids.append(int(_hf_logits(model, ids)[-1].argmax()))
    return ids[len(prompt):]


def _top2_gap(logits: torch.Tensor) -> float:
    top = logits.topk(2).values
    return float(top[0] - top[1])


@pytest.fixture(scope='module')
def checkpoint(tiny_model_factory):
    """`checkpoint(shape) -> path` of the tiny Qwen3 checkpoint of that shape."""
    return lambda shape: tiny_model_factory('qwen3', **SHAPES[shape])


@pytest.fixture(scope='module')
def reference(checkpoint):
    """`reference(shape, prompt_len, seed=0) -> Reference`, cached for the module."""
    models: dict[str, torch.nn.Module] = {}
    cache: dict[tuple, Reference] = {}

    def get(shape: str, prompt_len: int, seed: int = 0) -> Reference:
        key = (shape, prompt_len, seed)
        if key not in cache:
            if shape not in models:
                models[shape] = transformers.Qwen3ForCausalLM.from_pretrained(checkpoint(shape)).eval()
            model = models[shape]
            prompt = _prompt(prompt_len, model.config.vocab_size, seed)
            generated = _hf_greedy(model, prompt, NUM_NEW_TOKENS)
            cache[key] = Reference(prompt, generated, _hf_logits(model, prompt + generated))
        return cache[key]

    return get


make_engine = engine_factory(block_size=16, num_gpu_blocks=64)


def _run(engine: Engine, prompts: list[list[int]], max_new_tokens: int = NUM_NEW_TOKENS) -> list[EngineResult]:
    """Submit all prompts at once (one batch), step until idle checking integrity, and collect the results."""
    tokens: dict[int, list[int]] = {}
    reasons: dict[int, str | None] = {}

    def on_output(out):
        tokens[out.seq_id] += out.new_token_ids
        if out.finished:
            reasons[out.seq_id] = out.finish_reason

    seq_ids = []
    for prompt in prompts:
        seq_id = engine.add_request(prompt, SamplingParams(max_new_tokens=max_new_tokens), on_output,
                                    collect_logits=True)
        tokens[seq_id] = []
        seq_ids.append(seq_id)
    while engine.has_work:
        engine.step()
        engine.check_integrity()
    block_manager = engine.scheduler.block_manager
    assert block_manager.num_free == block_manager.num_blocks, 'KV blocks leaked after every request ended'
    assert set(reasons) == set(seq_ids), 'some requests never finished'
    return [EngineResult(tokens[s], engine.pop_collected_logits(s), reasons[s]) for s in seq_ids]


def _assert_matches_reference(result: EngineResult, ref: Reference, what: str, recomputed: bool = False) -> None:
    """Greedy tokens equal the reference until a near-tie; logits match over the common fed prefix.

    A preempted request feeds its tokens again from position 0, so its collected logits hold every pass; with
    `recomputed` only the last pass (the tail, covering every position once) is compared.
    """
    num_prompt = len(ref.prompt)
    assert len(result.tokens) == len(ref.generated), f'{what}: {len(result.tokens)} tokens generated'
    assert result.finish_reason == 'length', f'{what}: finish_reason {result.finish_reason!r}'
    num_fed = num_prompt + len(result.tokens) - 1
    if recomputed:
        assert result.logits.shape[0] >= num_fed, f'{what}: fed {result.logits.shape[0]} < {num_fed}'
        result = result._replace(logits=result.logits[-num_fed:])
    assert result.logits.shape[0] == num_fed, f'{what}: fed {result.logits.shape[0]}, expected {num_fed}'
    num_same = 0
    for i, (got, want) in enumerate(zip(result.tokens, ref.generated)):
        if got != want:
            gap = _top2_gap(ref.logits[num_prompt - 1 + i])
            assert gap < GAP_TOL, f'{what}: generated token {i} is {got}, reference {want} (top-2 gap {gap:.2e})'
            break
        num_same += 1
    rows = min(num_prompt + num_same, result.logits.shape[0])
    assert_close(result.logits[:rows], ref.logits[:rows], atol=LOGITS_TOL, rtol=LOGITS_TOL, what=f'{what} logits')


# ---- single requests ------------------------------------------------------------------------------------------
@pytest.mark.parametrize('prompt_len', PROMPT_LENS)
@pytest.mark.parametrize('shape', list(SHAPES))
def test_teacher_forced_logits_match_transformers(checkpoint, reference, shape, prompt_len):
    ref = reference(shape, prompt_len)
    full = ref.prompt + ref.generated
    (result,) = _run(make_engine(checkpoint(shape)), [full], max_new_tokens=1)
    # every position of prompt + reference continuation, each fed once
    assert_close(result.logits, ref.logits, atol=LOGITS_TOL, rtol=LOGITS_TOL, what=f'{shape} L{prompt_len}')


@pytest.mark.parametrize('prompt_len', PROMPT_LENS)
@pytest.mark.parametrize('shape', list(SHAPES))
def test_greedy_tokens_match_transformers_greedy(checkpoint, reference, shape, prompt_len):
    ref = reference(shape, prompt_len)
    (result,) = _run(make_engine(checkpoint(shape), block_size=8), [ref.prompt])
    _assert_matches_reference(result, ref, f'{shape} L{prompt_len}')


# ---- batching, chunking, paging --------------------------------------------------------------------------------
@pytest.mark.parametrize('shape', ['gqa-q4-kv2', 'head_dim32-hidden64-q4'])
def test_mixed_length_batch_matches_each_prompt_alone(checkpoint, reference, shape):
    refs = [reference(shape, n) for n in (33, 1, 65, 7)]
    engine = make_engine(checkpoint(shape))
    alone = [_run(engine, [ref.prompt])[0] for ref in refs]
    batch = _run(engine, [ref.prompt for ref in refs])
    for ref, one, batched in zip(refs, alone, batch):
        what = f'{shape} L{len(ref.prompt)}'
        assert batched.tokens == one.tokens, f'{what}: batched tokens differ from the prompt alone'
        assert_close(batched.logits, one.logits, atol=LOGITS_TOL, rtol=LOGITS_TOL, what=f'{what} batched vs alone')
        _assert_matches_reference(batched, ref, f'{what} batched')


@pytest.mark.parametrize('max_prefill_token_num', [3, 5])
def test_chunked_prefill_matches_unchunked(checkpoint, reference, max_prefill_token_num):
    shape = 'gqa-q4-kv2'
    refs = [reference(shape, n) for n in (65, 7, 33, 1)]
    prompts = [ref.prompt for ref in refs]
    unchunked = _run(make_engine(checkpoint(shape)), prompts)
    chunked = _run(make_engine(checkpoint(shape), max_prefill_token_num=max_prefill_token_num), prompts)
    for ref, whole, chunks in zip(refs, unchunked, chunked):
        what = f'L{len(ref.prompt)} max_prefill_token_num={max_prefill_token_num}'
        assert chunks.tokens == whole.tokens, f'{what}: chunked tokens differ from unchunked'
        assert_close(chunks.logits, whole.logits, atol=LOGITS_TOL, rtol=LOGITS_TOL, what=f'{what} chunked')
        _assert_matches_reference(chunks, ref, what)


@pytest.mark.parametrize('block_size,kernel_block_size', [(16, 4), (32, 8), (8, 1)],
                         ids=['block16-page4', 'block32-page8', 'block8-page1'])
def test_kernel_pages_smaller_than_blocks_match_reference(checkpoint, reference, block_size, kernel_block_size):
    shape = 'mha-q4-kv4'
    refs = [reference(shape, n) for n in (65, 33, 7, 1)]
    engine = make_engine(checkpoint(shape), block_size=block_size, kernel_block_size=kernel_block_size,
                     max_prefill_token_num=21)
    results = _run(engine, [ref.prompt for ref in refs])
    for ref, result in zip(refs, results):
        _assert_matches_reference(result, ref, f'L{len(ref.prompt)} block {block_size}/page {kernel_block_size}')


@pytest.mark.parametrize('kernel_block_size', [None, 4], ids=['page8', 'page4'])
def test_preempted_requests_recompute_to_the_same_outputs(checkpoint, reference, monkeypatch, kernel_block_size):
    shape = 'tied-embeddings'
    refs = [reference(shape, 30, seed) for seed in range(3)]
    # Blocks of 8: a 30-token prompt takes 4 blocks (3 full + 6 tokens) and its decodes a 5th at position 32.
    # The pool has 9: two requests run (8 blocks), the first to cross position 32 takes the last free block and
    # the second has nobody behind it to preempt, so it preempts itself and is recomputed later.
    engine = make_engine(checkpoint(shape), block_size=8, kernel_block_size=kernel_block_size, num_gpu_blocks=9)
    preempted = []
    preempt = engine.scheduler.preempt

    def counting_preempt(seq):
        preempted.append(seq.seq_id)
        preempt(seq)

    monkeypatch.setattr(engine.scheduler, 'preempt', counting_preempt)
    results = _run(engine, [ref.prompt for ref in refs])
    assert preempted, 'the pool was large enough: nothing was preempted'
    for ref, result in zip(refs, results):
        _assert_matches_reference(result, ref, f'seed {refs.index(ref)} with preemption', recomputed=True)


def test_mixed_chunking_paging_and_preemption_match_reference(checkpoint, reference, monkeypatch):
    shape = 'head_dim32-hidden64-q4'
    refs = [reference(shape, n, seed) for seed, n in enumerate((7, 1, 33, 65, 33))]
    # 6 blocks of 16 (4 pages each) for 5 requests needing 1 + 1 + 3 + 5 + 3 blocks, prefills cut into chunks
    # of at most 7 tokens: growing chunks and decodes preempt the latest arrivals.
    engine = make_engine(checkpoint(shape), block_size=16, kernel_block_size=4, num_gpu_blocks=6,
                     max_prefill_token_num=7)
    preempted = []
    preempt = engine.scheduler.preempt
    monkeypatch.setattr(engine.scheduler, 'preempt', lambda seq: (preempted.append(seq.seq_id), preempt(seq)))
    results = _run(engine, [ref.prompt for ref in refs])
    assert preempted, 'nothing was preempted'
    for i, (ref, result) in enumerate(zip(refs, results)):
        _assert_matches_reference(result, ref, f'request {i} (L{len(ref.prompt)})', recomputed=True)


# ---- request lifecycle -----------------------------------------------------------------------------------------
def test_aborted_requests_release_their_blocks(checkpoint, reference):
    refs = [reference('gqa-q4-kv2', n) for n in (65, 33)]
    engine = make_engine(checkpoint('gqa-q4-kv2'), max_prefill_token_num=16)
    reasons = {}
    seq_ids = [engine.add_request(ref.prompt, SamplingParams(max_new_tokens=50),
                                  lambda out: reasons.__setitem__(out.seq_id, out.finish_reason) if out.finished
                                  else None) for ref in refs]
    for _ in range(3):  # the 65-token prompt is mid-prefill, the 33-token one still waits
        engine.step()
        engine.check_integrity()
    assert engine.scheduler.block_manager.num_free < engine.scheduler.block_manager.num_blocks
    for seq_id in seq_ids:
        engine.abort_request(seq_id)
    engine.run_until_idle()
    engine.check_integrity()
    assert reasons == {seq_ids[0]: 'abort', seq_ids[1]: 'abort'}
    assert engine.scheduler.block_manager.num_free == engine.scheduler.block_manager.num_blocks
    # the engine keeps serving
    (result,) = _run(engine, [refs[1].prompt])
    _assert_matches_reference(result, refs[1], 'after abort')


def test_zero_max_new_tokens_finishes_without_forward(checkpoint):
    engine = make_engine(checkpoint('gqa-q4-kv2'))
    (result,) = _run(engine, [[1, 2, 3]], max_new_tokens=0)
    assert result.tokens == [] and result.finish_reason == 'length'
    assert result.logits.numel() == 0


def test_generation_stops_at_session_len(checkpoint, reference):
    ref = reference('gqa-q4-kv2', 33)
    # 5 blocks of 8 tokens: session_len 40, so a 33-token prompt can grow by 7 tokens only.
    engine = make_engine(checkpoint('gqa-q4-kv2'), block_size=8, num_gpu_blocks=5)
    assert engine.session_len == 40
    (result,) = _run(engine, [ref.prompt], max_new_tokens=NUM_NEW_TOKENS)
    assert result.finish_reason == 'length'
    assert result.tokens == ref.generated[:7]
    with pytest.raises(ValueError, match='session_len'):
        engine.add_request(list(range(40)), SamplingParams(max_new_tokens=1))
