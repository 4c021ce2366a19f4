"""Incremental detokenization and stop strings: matches transformers' decode, holds back what may begin a stop
string, costs linear time, and reports the real bytes of each token."""
from __future__ import annotations

import random
import time

import pytest

from lmdeploy.demo_model import build_tokenizer
from lmdeploy.serve.detokenizer import IncrementalDetokenizer, StopStringMatcher
from lmdeploy.serve.tokenizer import Tokenizer

TEXTS = ['Hello, world! The sea is wide.', 'Grüße aus Köln: 日本語のテキスト, emoji 🙂 and more.',
         'def f(x):\n    return x * 2\n\n<|im_end|> after a special token']


@pytest.fixture(scope='module')
def tokenizer(tmp_path_factory) -> Tokenizer:
    path = tmp_path_factory.mktemp('tok')
    build_tokenizer('qwen3').save_pretrained(str(path))
    return Tokenizer(str(path))


@pytest.mark.parametrize('text', TEXTS)
def test_deltas_join_to_transformers_decode(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.update([i]) for i in ids] + [detok.update([], final=True)]
    assert ''.join(deltas) == tokenizer.decode(ids)
    assert all('\ufffd' not in d for d in deltas)  # a split UTF-8 character is never sent in halves


@pytest.mark.parametrize('text', TEXTS)
def test_token_bytes_are_the_tokens_own_bytes(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert b''.join(tokenizer.token_bytes(i) for i in ids) == text.encode('utf-8')


@pytest.mark.parametrize('seed', range(5))
def test_stop_string_across_token_boundaries_is_cut_and_never_leaks(tokenizer, seed):
    rng = random.Random(seed)
    text = 'The quick brown fox jumps over the lazy dog near the river bank at noon.'
    start = rng.randrange(5, len(text) - 8)
    stop = text[start:start + rng.randint(2, 7)]
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [stop, 'never there'])
    expected = text[:text.find(stop)]
    sent, n = '', 0
    for token_id in ids:
        n += 1
        sent += detok.update([token_id])
        assert expected.startswith(sent)  # never a character past the cut
        if detok.stopped:
            break
    assert detok.stopped and sent == expected
    # the token that completed the stop string is the last one consumed
    assert stop not in tokenizer.decode(ids[:n - 1]) and stop in tokenizer.decode(ids[:n])
    assert detok.num_tokens == n


def test_held_back_prefix_is_flushed_when_the_request_ends_otherwise():
    matcher = StopStringMatcher(['STOP'])
    assert matcher.feed('abc ST') == 'abc '
    assert matcher.feed('O') == ''
    assert matcher.feed('', final=True) == 'STO'
    matcher = StopStringMatcher(['ab', 'bcd'])
    assert matcher.feed('xxb') == 'xx'
    assert matcher.feed('cd!') == '' and matcher.stopped


def _detok_seconds(tokenizer, ids: list[int]) -> float:
    best = float('inf')
    for _ in range(5):
        detok = IncrementalDetokenizer(tokenizer, ['never appears in it'])
        start = time.perf_counter()
        for token_id in ids:
            detok.update([token_id])
        best = min(best, time.perf_counter() - start)
    return best


def test_detokenization_is_linear_in_the_output_length(tokenizer):
    """16,000 tokens cost ~16x 1,000 tokens (a full re-decode per token would cost ~256x; the bound leaves room
    for a loaded machine)."""
    rng = random.Random(0)
    vocab = tokenizer.vocab_size - 8
    ids = [rng.randrange(vocab) for _ in range(16_000)]
    short, long = _detok_seconds(tokenizer, ids[:1000]), _detok_seconds(tokenizer, ids)
    assert long < 64 * short, (short, long)
    assert long < 20.0
