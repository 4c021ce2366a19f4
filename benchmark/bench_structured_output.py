"""Structured-output libraries compared on what the server needs: grammar compilation (cold, and the cache hit)
and the per-token cost of the allowed-token mask, for a JSON schema, free JSON and a regex.

Usage: python benchmark/bench_structured_output.py [TOKENIZER_FOLDER | VOCAB_SIZE]
(default: the demo model's 1k tokenizer; a number trains a synthetic byte-level BPE of that size, e.g. 50000)
Prints one line per library and grammar; the choice in lmdeploy/serve/structured/ follows these numbers
(docs/benchmarks.md records them).
"""
from __future__ import annotations

import json
import sys
import time

import torch
from transformers import AutoTokenizer

SCHEMA = {'type': 'object', 'properties': {
    'name': {'type': 'string', 'maxLength': 20}, 'age': {'type': 'integer', 'minimum': 0, 'maximum': 150},
    'tags': {'type': 'array', 'items': {'type': 'string', 'enum': ['a', 'b', 'c']}, 'maxItems': 3},
    'ok': {'type': 'boolean'}}, 'required': ['name', 'age', 'tags', 'ok'], 'additionalProperties': False}
TARGET = json.dumps({'name': 'Elias', 'age': 42, 'tags': ['a', 'c'], 'ok': True})
REGEX = r'\d{3}-\d{4} [a-z]+'
REGEX_TARGET = '555-1234 hello'


def _ms(seconds: float) -> str:
    return f'{seconds * 1e3:9.3f} ms'


def synthetic_tokenizer(vocab_size: int):
    """A byte-level BPE of about `vocab_size` tokens (the demo tokenizer's recipe, trained on seeded pseudo-words
    so that the merges fill a realistically large vocabulary)."""
    import random

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    rng = random.Random(0)
    letters = 'abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789{}[]":,._-'
    lines = [' '.join(''.join(rng.choice(letters) for _ in range(rng.randint(1, 9))) for _ in range(20))
             for _ in range(60000)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(lines, trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token='</s>', extra_special_tokens=['</s>'])


def bench_xgrammar(tok, vocab: int, target_ids: list[int]) -> None:
    import xgrammar as xgr
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab)
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=True)
    for name, make, ids in (('json_schema', lambda: compiler.compile_json_schema(json.dumps(SCHEMA)), target_ids),
                            ('regex', lambda: compiler.compile_regex(REGEX), None)):
        start = time.perf_counter()
        compiled = make()
        cold = time.perf_counter() - start
        start = time.perf_counter()
        make()
        warm = time.perf_counter() - start
        ids = ids if ids is not None else tok.encode(REGEX_TARGET, add_special_tokens=False)
        matcher = xgr.GrammarMatcher(compiled)
        mask = xgr.allocate_token_bitmask(1, vocab)
        start = time.perf_counter()
        for t in ids:
            matcher.fill_next_token_bitmask(mask, 0)
            assert matcher.accept_token(t), 'the target must be accepted'
        per_token = (time.perf_counter() - start) / len(ids)
        print(f'xgrammar   {name:12s} compile {_ms(cold)}  cached {_ms(warm)}  mask+accept {_ms(per_token)}/token')


def bench_llguidance(tok, vocab: int, target_ids: list[int]) -> None:
    import llguidance
    import llguidance.hf
    import llguidance.torch as lt
    lltok = llguidance.hf.from_tokenizer(tok, vocab)
    for name, grammar, ids in (('json_schema', llguidance.LLMatcher.grammar_from_json_schema(SCHEMA), target_ids),
                               ('regex', llguidance.LLMatcher.grammar_from_regex(REGEX), None)):
        start = time.perf_counter()
        matcher = llguidance.LLMatcher(lltok, grammar)
        cold = time.perf_counter() - start
        ids = ids if ids is not None else tok.encode(REGEX_TARGET, add_special_tokens=False)
        mask = lt.allocate_token_bitmask(1, vocab)
        start = time.perf_counter()
        for t in ids:
            lt.fill_next_token_bitmask(matcher, mask, 0)
            assert matcher.consume_token(t), matcher.get_error()
        per_token = (time.perf_counter() - start) / len(ids)
        print(f'llguidance {name:12s} compile {_ms(cold)}  (lazy)        mask+accept {_ms(per_token)}/token')


def main() -> None:
    arg = sys.argv[1] if len(sys.argv) > 1 else None
    if arg is not None and arg.isdigit():
        folder, tok = f'synthetic BPE ({arg})', synthetic_tokenizer(int(arg))
    else:
        if arg is None:
            from lmdeploy.demo_model import get_demo_model_path
            arg = get_demo_model_path('qwen3')
        folder, tok = arg, AutoTokenizer.from_pretrained(arg)
    vocab = len(tok)
    target_ids = tok.encode(TARGET, add_special_tokens=False)
    print(f'tokenizer {folder}: {vocab} tokens; JSON target {len(target_ids)} tokens; torch {torch.__version__}')
    bench_xgrammar(tok, vocab, target_ids)
    bench_llguidance(tok, vocab, target_ids)


if __name__ == '__main__':
    main()
