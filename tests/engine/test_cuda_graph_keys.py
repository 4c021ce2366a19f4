"""CUDA-graph keys and policy (CPU): which batch sizes are captured, which prefills replay a graph (token and
sequence buckets, the smallest key that fits), the prefill-graph limit and its environment switches."""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import sys

import pytest
import torch
from graph_inputs import decode_inputs, prefill_inputs

from lmdeploy.messages import PytorchEngineConfig
from lmdeploy.pytorch.engine.cuda_graph import GraphKey, capture_sizes
from lmdeploy.pytorch.engine.engine import Engine


def test_capture_sizes():
    assert capture_sizes(1) == [1]
    assert capture_sizes(5) == [1, 2, 4, 5]
    assert capture_sizes(16) == [1, 2, 4, 8, 16]
    assert capture_sizes(40) == [1, 2, 4, 8, 16, 32, 40]
    assert capture_sizes(128)[-3:] == [96, 112, 128]


def test_cpu_agent_has_no_graphs(tiny_model_factory):
    engine = Engine(tiny_model_factory('qwen3_5'), PytorchEngineConfig(device_type='cpu', num_gpu_blocks=32))
    assert engine.agent.graph_runner is None


def test_prefill_graph_policy():
    """Prefill graphs for dense models, and for hybrids whose token-by-token gated delta rule is one fused fla
    launch (bf16 / fp16 with fla-core installed); not for the torch kernels' per-token loop (float32)."""
    from lmdeploy.pytorch.backends import cuda as cuda_backend
    assert cuda_backend.prefill_graphs_supported(torch.float32, is_hybrid=False)
    assert cuda_backend.prefill_graphs_supported(torch.bfloat16, is_hybrid=False)
    assert not cuda_backend.prefill_graphs_supported(torch.float32, is_hybrid=True)
    assert cuda_backend.prefill_graphs_supported(torch.bfloat16, is_hybrid=True) == cuda_backend._fla_available()



def _fake_fla(monkeypatch, takes_chunk_indices: bool):
    """An importable `fla` whose chunked rule has fla-core 0.6.0's signature (`chunk_indices` named) or 0.5.x's
    (the keyword swallowed by `**kwargs`)."""
    import types
    if takes_chunk_indices:
        def chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=None, chunk_indices=None, **kwargs):
            raise AssertionError('not run')
    else:
        def chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=None, **kwargs):
            raise AssertionError('not run')
    gdr = types.ModuleType('fla.ops.gated_delta_rule')
    gdr.chunk_gated_delta_rule = chunk_gated_delta_rule
    for name, module in (('fla', types.ModuleType('fla')), ('fla.ops', types.ModuleType('fla.ops')),
                         ('fla.ops.gated_delta_rule', gdr)):
        monkeypatch.setitem(sys.modules, name, module)


@pytest.mark.parametrize('takes', [True, False])
@pytest.mark.parametrize('gdr_mode', ['chunked', 'recurrent'])
def test_hybrid_prefill_graphs_need_an_fla_that_takes_chunk_indices(monkeypatch, caplog, takes, gdr_mode):
    """fla-core before 0.6.0 drops precomputed chunk indices and syncs to derive them: no hybrid prefill graph
    could be captured with its chunked rule, so those prefills stay eager, with a warning naming the fix; the
    token-by-token graph rule needs no indices."""
    from lmdeploy.pytorch.backends import cuda as cuda_backend
    _fake_fla(monkeypatch, takes)
    monkeypatch.setenv('LMDEPLOY_GRAPH_GDR', gdr_mode)
    cuda_backend.fla_takes_chunk_indices.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger='lmdeploy'):
            supported = cuda_backend.prefill_graphs_supported(torch.bfloat16, is_hybrid=True)
            assert cuda_backend.prefill_graphs_supported(torch.bfloat16, is_hybrid=False)
    finally:
        cuda_backend.fla_takes_chunk_indices.cache_clear()
    assert supported == (takes or gdr_mode == 'recurrent')
    warned = [r.getMessage() for r in caplog.records if 'chunk indices' in r.getMessage()]
    assert bool(warned) == (not supported)
    assert all('fla-core>=0.6.0' in w for w in warned)

def test_graph_keys():
    from lmdeploy.pytorch.engine.cuda_graph import CUDAGraphRunner
    runner = CUDAGraphRunner(None, None, max_batch_size=40, max_pages=6, device=torch.device('cpu'),
                             max_prefill_tokens=300)
    assert runner.token_buckets == (16, 32, 64, 128, 256, 384)
    assert runner.key_of(decode_inputs(3, 2)) == GraphKey(4, 4, True)
    assert runner.key_of(decode_inputs(33, 2)) == GraphKey(40, 40, True)
    assert runner.key_of(decode_inputs(3, 7)) is None            # wider block table than the buffers
    prefill = dataclasses.replace(decode_inputs(3, 2), input_ids=torch.zeros(70, dtype=torch.int64),
                                  max_seqlen_q=60)
    assert runner.key_of(prefill) == GraphKey(128, 8, False)       # 3 sequences + pad + one empty
    assert runner.key_of(dataclasses.replace(prefill, input_ids=torch.zeros(300, dtype=torch.int64))) == \
        GraphKey(384, 8, False)
    assert runner.key_of(dataclasses.replace(prefill, input_ids=torch.zeros(385, dtype=torch.int64))) is None
    mixed = dataclasses.replace(decode_inputs(39, 2), input_ids=torch.zeros(60, dtype=torch.int64), max_seqlen_q=9)
    assert runner.key_of(mixed) == GraphKey(64, 42, False)         # a full batch: sequence bucket 40 + 2
    small = dataclasses.replace(decode_inputs(20, 2), input_ids=torch.zeros(30, dtype=torch.int64), max_seqlen_q=9)
    assert runner.key_of(small) == GraphKey(64, 32, False)         # more tokens than sequences: not 32


def _reference_prefill_key(tokens, seqs, token_buckets, seq_buckets):
    fits = [(s, t) for s in seq_buckets for t in token_buckets if s >= seqs + 2 and t >= tokens and t > s]
    return GraphKey(*min(fits)[::-1], False) if fits else None


def test_prefill_buckets_and_keys():
    """Token buckets cover the largest forward (capped at 4096); sequence buckets 4, 8, ... then a full batch plus
    two; every key is the smallest (sequences, then tokens) that fits, as a brute-force search finds it."""
    from lmdeploy.pytorch.engine.cuda_graph import (
        PREFILL_TOKEN_BUCKETS,
        prefill_key,
        prefill_seq_buckets,
        prefill_token_buckets,
    )
    assert prefill_token_buckets(0) == ()
    assert prefill_token_buckets(56) == (16, 32, 64)
    assert prefill_token_buckets(4096) == PREFILL_TOKEN_BUCKETS
    assert prefill_token_buckets(1100)[-3:] == (768, 1024, 1280)
    for small, large in zip(PREFILL_TOKEN_BUCKETS[4:], PREFILL_TOKEN_BUCKETS[5:]):   # bounded padding past 256
        assert large <= 1.5 * small and (small < 1024 or large <= 1.25 * small)
    assert prefill_token_buckets(9000)[-1] == 4096
    assert prefill_seq_buckets(1) == (3,) and prefill_seq_buckets(8) == (4, 8, 10)
    assert prefill_seq_buckets(64) == (4, 8, 16, 32, 64, 66)
    for max_batch, max_tokens in ((1, 64), (8, 300), (64, 4096)):
        tb, sb = prefill_token_buckets(max_tokens), prefill_seq_buckets(max_batch)
        for seqs in range(1, max_batch + 1):
            for tokens in sorted({seqs, seqs + 1, 15, 16, 17, 63, 64, 65, 255, 256, 257, 4095, 4096, 4097}):
                if tokens >= seqs:
                    assert prefill_key(tokens, seqs, tb, sb) == _reference_prefill_key(tokens, seqs, tb, sb)


def test_prefill_graph_tokens_env(monkeypatch):
    from lmdeploy.pytorch.backends import cuda as cuda_backend
    from lmdeploy.pytorch.engine.cuda_graph import DEFAULT_PREFILL_GRAPH_TOKENS, prefill_graph_tokens, prefill_warm_keys
    monkeypatch.delenv('LMDEPLOY_PREFILL_GRAPH_TOKENS', raising=False)
    assert prefill_graph_tokens(8192 + 64) == DEFAULT_PREFILL_GRAPH_TOKENS and prefill_graph_tokens(56) == 56
    monkeypatch.setenv('LMDEPLOY_PREFILL_GRAPH_TOKENS', '4096')
    assert prefill_graph_tokens(8192 + 64) == 4096
    monkeypatch.setenv('LMDEPLOY_PREFILL_GRAPH_TOKENS', '256')
    assert prefill_graph_tokens(8192) == 256
    monkeypatch.setenv('LMDEPLOY_PREFILL_GRAPH_TOKENS', '0')
    assert prefill_graph_tokens(8192) == 0
    assert prefill_warm_keys((16, 32, 64), (4, 8, 10)) == [GraphKey(64, 4, False), GraphKey(32, 4, False),
                                                          GraphKey(16, 4, False)]
    monkeypatch.setenv('LMDEPLOY_GRAPH_GDR', 'chunked')
    assert cuda_backend.graph_gdr_chunked()
    monkeypatch.setenv('LMDEPLOY_GRAPH_GDR', 'recurrent')
    assert not cuda_backend.graph_gdr_chunked()
    monkeypatch.setenv('LMDEPLOY_GRAPH_GDR', 'fast')
    with pytest.raises(ValueError, match='LMDEPLOY_GRAPH_GDR'):
        cuda_backend.graph_gdr_chunked()


def test_prefill_graph_limit_and_failed_keys_run_eagerly():
    from lmdeploy.pytorch.engine.cuda_graph import CUDAGraphRunner
    runner = CUDAGraphRunner(None, None, max_batch_size=8, max_pages=6, device=torch.device('cpu'),
                             max_prefill_tokens=256, max_prefill_graphs=1)
    one, two = prefill_inputs([20]), prefill_inputs([100])
    assert runner.key_of(one) == GraphKey(32, 4, False)
    runner.failed.add(GraphKey(32, 4, False))
    assert runner.key_of(one) is None
    runner.graphs[GraphKey(128, 4, False)] = (None, None)          # one prefill graph: the limit
    assert runner.key_of(two) == GraphKey(128, 4, False)           # captured keys still replay
    assert runner.key_of(prefill_inputs([40])) is None            # new ones run eagerly
    assert runner.key_of(decode_inputs(3, 2)) == GraphKey(4, 4, True)


def test_warm_prefill_keys_cover_the_batches_asked_for(monkeypatch):
    """Start-up prefill graphs for batches of up to n sequences: every token bucket at every sequence bucket up
    to the one of n sequences (n = 2: sequence bucket 4 only), so a mixed batch of a prompt beside up to n - 1
    decodes replays a graph captured at start-up instead of capturing on first use. The engine's n is its
    `max_batch_size` (every bucket) unless `LMDEPLOY_WARM_PREFILL_SEQS` says otherwise."""
    from lmdeploy.pytorch.engine.cuda_graph import (
        prefill_key,
        prefill_seq_buckets,
        prefill_token_buckets,
        prefill_warm_keys,
        warm_prefill_seqs,
    )
    tokens, seqs = prefill_token_buckets(8192), prefill_seq_buckets(128)
    default = prefill_warm_keys(tokens, seqs)
    assert {k.num_seqs for k in default} == {4} and len(default) == len(tokens)
    assert default == sorted(default, reverse=True)
    for n in (20, 128):
        keys = set(prefill_warm_keys(tokens, seqs, n))
        assert set(default) <= keys
        # every batch of 1..n sequences and any token count the graphs cover finds its key among them
        for num_seqs in range(1, n + 1):
            for num_tokens in (num_seqs, num_seqs + 1, 300, 4096):
                key = prefill_key(max(num_tokens, num_seqs), num_seqs, tokens, seqs)
                assert key is None or key in keys, (n, num_seqs, num_tokens)
    assert {k.num_seqs for k in prefill_warm_keys(tokens, seqs, 20)} == {4, 8, 16, 32}
    monkeypatch.delenv('LMDEPLOY_WARM_PREFILL_SEQS', raising=False)
    assert warm_prefill_seqs(128) == 128
    all_keys = set(prefill_warm_keys(tokens, seqs, 128))
    assert {k.num_seqs for k in all_keys} == set(seqs)
    monkeypatch.setenv('LMDEPLOY_WARM_PREFILL_SEQS', '64')
    assert warm_prefill_seqs(128) == 64
    for bad in ('0', '-3', 'all'):
        monkeypatch.setenv('LMDEPLOY_WARM_PREFILL_SEQS', bad)
        with pytest.raises(ValueError, match='LMDEPLOY_WARM_PREFILL_SEQS'):
            warm_prefill_seqs(128)


def test_split_layers_reads_its_variable(monkeypatch):
    """Prefill graphs split after `LMDEPLOY_GRAPH_SPLIT` layer counts (default 2 and 10); '0' or empty: one graph."""
    from lmdeploy.pytorch.engine.graph_chain import DEFAULT_GRAPH_SPLIT, split_layers
    monkeypatch.delenv('LMDEPLOY_GRAPH_SPLIT', raising=False)
    assert split_layers() == DEFAULT_GRAPH_SPLIT == (2, 10)
    for raw, want in (('4', (4,)), ('10, 2,2', (2, 10)), ('0', ()), ('', ()), ('0,3', (3,))):
        monkeypatch.setenv('LMDEPLOY_GRAPH_SPLIT', raw)
        assert split_layers() == want, raw
    for bad in ('-1', 'two', '2;10', '1.5'):
        monkeypatch.setenv('LMDEPLOY_GRAPH_SPLIT', bad)
        with pytest.raises(ValueError, match='LMDEPLOY_GRAPH_SPLIT'):
            split_layers()


@pytest.mark.parametrize('arch', ['qwen3', 'qwen3_5', 'qwen3_next'])
def test_models_call_after_layer_once_per_layer_in_order(tiny_model_factory, arch):
    """The hook the split capture relies on (`StepContext.after_layer`): every model calls it with each decoder
    layer's index, in order, after that layer and before the next one; the forward's logits are unchanged."""
    from lmdeploy.pytorch.messages import SamplingParams
    engine = Engine(tiny_model_factory(arch), PytorchEngineConfig(
        device_type='cpu', dtype='float32', block_size=16, num_gpu_blocks=64, max_batch_size=4,
        enable_prefix_caching=False))
    agent, calls, starts = engine.agent, [], []
    layers = agent.model.model.layers
    for i, layer in enumerate(layers):  # (layer, hooks called before it started), through what the model calls
        name = 'forward_residual' if hasattr(layer, 'forward_residual') else 'forward'
        run = getattr(layer, name)

        def probe(*args, _i=i, _run=run, **kwargs):
            starts.append((_i, len(calls)))
            return _run(*args, **kwargs)
        setattr(layer, name, probe)

    def logits() -> torch.Tensor:
        seq = engine.add_request(list(range(1, 20)), SamplingParams(max_new_tokens=1), collect_logits=True)
        while engine.has_work:
            engine.step()
        return engine.pop_collected_logits(seq)
    reference = logits()
    plain = agent._context
    agent._context = lambda inputs, routes=None: dataclasses.replace(plain(inputs, routes), after_layer=calls.append)
    starts.clear()
    hooked = logits()
    assert calls == list(range(len(layers))) and len(layers) >= 2
    assert starts == [(i, i) for i in range(len(layers))]  # layer i begins after the hook of layer i - 1
    torch.testing.assert_close(hooked, reference, rtol=0, atol=0)


def test_a_failed_capture_releases_the_pool_it_left_recording(monkeypatch):
    """`end_stale_pool_recording` ends the allocator's routing to the pool of a failed capture (torch builds that
    check the capture's end before ending it leave it on); where there is none (torch raised: not recording), or no
    pool yet, nothing happens. The GPU side: `test_cuda_graph.py`'s failed-capture test."""
    from lmdeploy.pytorch.engine import cuda_graph
    recording = {(0, 7)}
    calls = []

    def end(device_index, pool):
        calls.append((device_index, pool))
        if pool not in recording:
            raise RuntimeError('endAllocatePool: not currently recording to mempool_id')
        recording.discard(pool)
    monkeypatch.setattr(torch._C, '_cuda_endAllocateToPool', end, raising=False)
    device = torch.device('cuda', 1)
    assert cuda_graph.end_stale_pool_recording(device, (0, 7))
    assert not recording
    assert not cuda_graph.end_stale_pool_recording(device, (0, 7))  # already released: torch's error swallowed
    assert not cuda_graph.end_stale_pool_recording(device, None)
    assert calls == [(1, (0, 7)), (1, (0, 7))]


def test_recovery_after_a_failed_capture_takes_a_new_pool_kept_alive(monkeypatch):
    """`recover_from_failed_capture` ends the old pool's stale recording, captures one small kernel into a new pool
    (clearing torch's capture state) and returns that pool with the graph that keeps it alive; where even that
    capture fails, a clear error (`CaptureStateError`, which start-up's capture loop does not swallow). Torch's
    capture calls are faked here (the GPU side: `test_cuda_graph.py`'s failed-capture test)."""
    from lmdeploy.pytorch.engine import cuda_graph
    ended, captured, broken = [], [], []

    class FakeGraph:
        pass

    @contextlib.contextmanager
    def fake_capture(graph, pool=None):
        if broken:
            raise RuntimeError('CUDA error: operation failed due to a previous error during capture')
        captured.append((graph, pool))
        yield

    monkeypatch.setattr(cuda_graph, 'end_stale_pool_recording', lambda device, pool: ended.append(pool))
    monkeypatch.setattr(torch.cuda, 'CUDAGraph', FakeGraph)
    monkeypatch.setattr(torch.cuda, 'graph', fake_capture)
    monkeypatch.setattr(torch.cuda, 'graph_pool_handle', lambda: (0, 99))
    monkeypatch.setattr(torch.cuda, 'synchronize', lambda device=None: None)
    device = torch.device('cpu')  # the small kernel's tensor: the fake capture does not care where
    pool, graph = cuda_graph.recover_from_failed_capture(device, (0, 7))
    assert pool == (0, 99) and ended == [(0, 7)] and captured == [(graph, (0, 99))]
    broken.append(True)
    with pytest.raises(cuda_graph.CaptureStateError, match='does not work after a failed capture'):
        cuda_graph.recover_from_failed_capture(device, (0, 99))
