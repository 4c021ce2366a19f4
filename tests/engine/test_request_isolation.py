"""One bad request fails alone: sampling parameters are checked at admission against the ranges the sampling
kernels accept, and whatever still fails while a batch's sampling inputs are built fails only its own request while
the rest of the forward (cache hits included) runs and returns the same tokens as a cache-off engine.

Geometry: block_size 16, tiny Qwen3.5 (hybrid), a warm 40-token prefix (prompt-end checkpoint at 40 with kept
logits), then four requests in one forward: three that extend the prefix (hits at 40) and one faulty one.
"""
from __future__ import annotations

import pytest
import torch
from engines import engine_factory
from numeric import assert_close

from lmdeploy.messages import GenerationConfig, PytorchEngineConfig
from lmdeploy.pytorch.engine import inputs_maker
from lmdeploy.pytorch.engine.engine import Engine
from lmdeploy.pytorch.messages import SamplingParams
from lmdeploy.serve.pipeline import Pipeline

B = 16


make_engine = engine_factory(block_size=B, kernel_block_size=8, num_gpu_blocks=64, max_batch_size=8,
                             max_prefill_token_num=512, enable_prefix_caching=True)


def ids(length: int, seed: int) -> list[int]:
    return torch.randint(0, 1000, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope='module')
def hybrid_path(tiny_model_factory):
    return tiny_model_factory('qwen3_5')


class Collected:
    def __init__(self):
        self.tokens: list[int] = []
        self.cached = 0
        self.finish_reason = None
        self.error = None

    def __call__(self, out):
        self.tokens += out.new_token_ids
        self.cached = out.num_cached
        if out.finished:
            self.finish_reason, self.error = out.finish_reason, out.error


def run(engine: Engine, requests: list[tuple[list[int], SamplingParams]]) -> tuple[list[Collected], list[int]]:
    """Submit together, step to idle checking the pools after every step; returns outputs and per-step batch sizes."""
    outs, seq_ids = [], []
    for prompt, params in requests:
        outs.append(Collected())
        seq_ids.append(engine.add_request(prompt, params, callback=outs[-1], collect_logits=True))
    sizes = []
    schedule = engine.scheduler.schedule

    def recording():
        out = schedule()
        sizes.append(len(out.seqs) + len(out.logits_hits))
        return out

    engine.scheduler.schedule = recording
    try:
        for _ in range(200):
            if not engine.has_work:
                break
            engine.step()
            engine.check_integrity()
    finally:
        engine.scheduler.schedule = schedule
    assert not engine.has_work
    for out, seq_id in zip(outs, seq_ids):
        out.logits = engine.pop_collected_logits(seq_id) if seq_id in engine._collected_logits else None
    return outs, sizes


GREEDY3 = SamplingParams(max_new_tokens=3)


@pytest.mark.parametrize('bad_is', ['extension-hit', 'identical-prompt-hit'])
@pytest.mark.parametrize('fault', ['top_k-overflow', 'raising-row'])
def test_a_bad_row_fails_alone_while_three_cobatched_cache_hits_complete(hybrid_path, monkeypatch, fault, bad_is):
    engine = make_engine(hybrid_path)
    prefix = ids(40, 1)
    run(engine, [(prefix, GREEDY3)])  # warm: a prompt-end checkpoint at 40 (2 full blocks + 8 tokens), logits kept
    good = [prefix + ids(5 + k, 10 + k) for k in range(3)]
    bad_prompt = prefix + ids(7, 20) if bad_is == 'extension-hit' else list(prefix)
    if fault == 'top_k-overflow':
        # Admission would reject it: let it through to reach the batch's sampling inputs.
        bad = SamplingParams(max_new_tokens=3, temperature=1.0, top_k=2**63)
        monkeypatch.setattr(SamplingParams, 'validate', lambda self, vocab_size=None: None)
    else:
        bad = SamplingParams(max_new_tokens=5)  # marks the row to fail
        real = inputs_maker.sampling_row

        def faulty(seq, generators):
            if seq.sampling.max_new_tokens == 5:
                raise RuntimeError('injected fault')
            return real(seq, generators)

        monkeypatch.setattr(inputs_maker, 'sampling_row', faulty)
    outs, sizes = run(engine, [(good[0], GREEDY3), (bad_prompt, bad), (good[1], GREEDY3), (good[2], GREEDY3)])
    monkeypatch.undo()
    assert sizes[0] == 4, 'the four requests must share their first forward'
    failed = outs[1]
    assert failed.finish_reason == 'error' and failed.tokens == []
    assert ('top_k' in failed.error) if fault == 'top_k-overflow' else ('injected fault' in failed.error)
    cold = make_engine(hybrid_path, cache=False)
    for prompt, out in zip(good, (outs[0], outs[2], outs[3])):
        assert out.finish_reason == 'length' and out.error is None
        assert out.cached == 40, 'each good request resumes from the warm checkpoint'
        (ref,), _ = run(cold, [(prompt, GREEDY3)])
        assert out.tokens == ref.tokens
        assert_close(out.logits, ref.logits[40:], atol=1e-4, rtol=0, what='warm logits')
    # Nothing leaked: only the cache holds blocks and rows, and the engine keeps serving.
    trie_blocks, ck_slots = engine.scheduler.trie.owners()
    assert engine.scheduler.block_manager.num_free + sum(trie_blocks.values()) == 64
    (again,), _ = run(engine, [(bad_prompt, GREEDY3)])
    assert again.finish_reason == 'length' and len(again.tokens) == 3


BAD_PARAMS = {
    'top_k-2**63': (dict(top_k=2**63), 'top_k'),
    'top_k-negative': (dict(top_k=-1), 'top_k'),
    'top_k-float': (dict(top_k=2.0), 'top_k'),
    'top_p-0': (dict(top_p=0.0), 'top_p'),
    'top_p-nan': (dict(top_p=float('nan')), 'top_p'),
    'temperature-inf': (dict(temperature=float('inf')), 'temperature'),
    'temperature-past-float32': (dict(temperature=1e39), 'temperature'),
    'temperature-negative': (dict(temperature=-0.5), 'temperature'),
    'repetition_penalty-huge': (dict(repetition_penalty=1e39), 'repetition_penalty'),
    'repetition_penalty-0': (dict(repetition_penalty=0.0), 'repetition_penalty'),
    'repetition_penalty-subnormal': (dict(repetition_penalty=1e-40), 'repetition_penalty'),
    'repetition_penalty-nan': (dict(repetition_penalty=float('nan')), 'repetition_penalty'),
    'max_new_tokens-negative': (dict(max_new_tokens=-1), 'max_new_tokens'),
    'max_new_tokens-bool': (dict(max_new_tokens=True), 'max_new_tokens'),
    'min_new_tokens-negative': (dict(min_new_tokens=-3), 'min_new_tokens'),
    'seed-2**64': (dict(random_seed=2**64), 'random_seed'),
    'seed-below-int64': (dict(random_seed=-2**63 - 1), 'random_seed'),
    'logprobs-past-64': (dict(logprobs=65), 'logprobs'),
    'stop-id-past-vocab': (dict(stop_token_ids=(5000,)), 'stop_token_ids'),
    'stop-sequence-empty': (dict(stop_sequences=((),)), 'stop_sequences'),
}


@pytest.mark.parametrize('params,field', BAD_PARAMS.values(), ids=BAD_PARAMS.keys())
def test_admission_rejects_parameters_the_kernels_cannot_take_naming_the_field(hybrid_path, params, field):
    engine = _shared_engine(hybrid_path)
    with pytest.raises(ValueError, match=field):
        engine.add_request(ids(8, 3), SamplingParams(**params))
    assert not engine.has_work, 'nothing may be queued for a rejected request'


_ENGINES: dict[str, Engine] = {}


def _shared_engine(path: str) -> Engine:
    if path not in _ENGINES:
        _ENGINES[path] = make_engine(path, num_gpu_blocks=16)
    return _ENGINES[path]


EDGE_PARAMS = {
    'top_k-int64-max': dict(temperature=1.0, top_k=2**63 - 1),
    'tiny-repetition-penalty': dict(temperature=1.0, repetition_penalty=1.2e-38),
    'huge-repetition-penalty': dict(temperature=1.0, repetition_penalty=3.4e38),
    'tiny-temperature': dict(temperature=1e-30),
    'huge-temperature': dict(temperature=3.4e38, top_p=0.5),
    'seed-uint64-max': dict(temperature=1.0, random_seed=2**64 - 1),
    'seed-int64-min': dict(temperature=1.0, random_seed=-2**63),
}


@pytest.mark.parametrize('params', EDGE_PARAMS.values(), ids=EDGE_PARAMS.keys())
def test_parameters_at_the_edges_of_the_accepted_ranges_sample_without_error(hybrid_path, params):
    engine = _shared_engine(hybrid_path)
    (out,), _ = run(engine, [(ids(20, 4), SamplingParams(max_new_tokens=4, **params))])
    assert out.finish_reason == 'length' and out.error is None and len(out.tokens) == 4
    assert all(0 <= t < engine.model_config.vocab_size for t in out.tokens)


def test_pipe_responses_carry_the_error_of_a_failed_request(tiny_model_factory, monkeypatch):
    pipe = Pipeline(tiny_model_factory('qwen3'), PytorchEngineConfig(device_type='cpu', block_size=B,
                                                                        num_gpu_blocks=64, max_batch_size=4))
    real = inputs_maker.sampling_row

    def faulty(seq, generators):
        if seq.sampling.max_new_tokens == 7:
            raise RuntimeError('injected fault')
        return real(seq, generators)

    monkeypatch.setattr(inputs_maker, 'sampling_row', faulty)
    try:
        gens = [GenerationConfig(max_new_tokens=7, ignore_eos=True),
                GenerationConfig(max_new_tokens=3, ignore_eos=True)]
        bad, ok = pipe([[1, 2, 3, 4], [5, 6, 7, 8]], gens)
        assert bad.finish_reason == 'error' and 'injected fault' in bad.error
        assert ok.finish_reason == 'length' and ok.error is None and ok.generate_token_len == 3
        last = [r for r in pipe.stream_infer([1, 2, 3, 4], gens[0])][-1]
        assert last.finish_reason == 'error' and 'injected fault' in last.error
    finally:
        pipe.close()
