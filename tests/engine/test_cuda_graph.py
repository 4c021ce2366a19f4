"""CUDA graphs (decode batches and small prefills): padding contract (CPU) and replay against eager mode (GPU)."""
from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from lmdeploy.messages import PytorchEngineConfig
from lmdeploy.pytorch.engine.cuda_graph import GraphKey, _StaticInputs, capture_sizes
from lmdeploy.pytorch.engine.engine import Engine
from lmdeploy.pytorch.messages import SamplingParams
from lmdeploy.pytorch.model_inputs import ModelInputs


def test_capture_sizes():
    assert capture_sizes(1) == [1]
    assert capture_sizes(5) == [1, 2, 4, 5]
    assert capture_sizes(16) == [1, 2, 4, 8, 16]
    assert capture_sizes(40) == [1, 2, 4, 8, 16, 32, 40]
    assert capture_sizes(128)[-3:] == [96, 112, 128]


def _decode_inputs(batch: int, width: int) -> ModelInputs:
    ar = torch.arange(batch, dtype=torch.int64)
    return ModelInputs(
        input_ids=ar + 100, position_ids=ar + 10, q_lens=torch.ones(batch, dtype=torch.int64), kv_lens=ar + 11,
        cu_seqlens_q=torch.arange(batch + 1), block_tables=(ar[:, None] * width + torch.arange(width)) + 1,
        slot_mapping=ar * 64 + 5, logits_indices=ar, state_ids=ar + 1, is_fresh=torch.zeros(batch, dtype=torch.bool),
        q_lens_list=[1] * batch, kv_lens_list=(ar + 11).tolist(), max_seqlen_q=1, max_seqlen_k=batch + 10)


def test_static_inputs_pad_rows_are_inert():
    """Rows past the batch must be padding the kernels ignore: kv_len 0, KV slot -1, dummy state row 0."""
    static = _StaticInputs(max_tokens=8, max_seqs=8, max_pages=6, device=torch.device('cpu'))
    static.fill_decode(_decode_inputs(7, 6), 8)     # a large batch first leaves non-padding values behind
    static.fill_decode(_decode_inputs(3, 2), 4)
    view = static.view(GraphKey(4, 4, True))
    assert view.input_ids.tolist() == [100, 101, 102, 0]
    assert view.position_ids.tolist() == [10, 11, 12, 0]
    assert view.kv_lens.tolist() == [11, 12, 13, 0]
    assert view.slot_mapping.tolist() == [5, 69, 133, -1]
    assert view.state_ids.tolist() == [1, 2, 3, 0]
    assert view.block_tables[:3, :2].tolist() == [[1, 2], [3, 4], [5, 6]]
    assert view.cu_seqlens_q.tolist() == [0, 1, 2, 3, 4] and view.is_decode and view.batch_size == 4


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


@pytest.fixture(scope='module', autouse=True)
def wide_chunked_prefill_graphs():
    """Every engine of this file: prefill graphs up to 4096 tokens, fla's chunked kernel inside them."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv('LMDEPLOY_PREFILL_GRAPH_TOKENS', '4096')
        mp.setenv('LMDEPLOY_GRAPH_GDR', 'chunked')
        yield


def _generate(engine: Engine, prompts: list[list[int]], max_new_tokens: int, stagger: int = 0):
    """Greedy generation; request i joins after i * stagger steps, so decode batches change size over time."""
    outs: dict[int, list[int]] = {}
    ids: list[int] = []
    pending = list(prompts)
    steps = 0
    while pending or engine.has_work:
        while pending and len(ids) * stagger <= steps:
            ids.append(engine.add_request(pending.pop(0), SamplingParams(max_new_tokens=max_new_tokens),
                                          collect_logits=True,
                                          callback=lambda o: outs.setdefault(o.seq_id, []).extend(o.new_token_ids)))
        engine.step()
        engine.check_integrity()
        steps += 1
    return [(outs[i], engine.pop_collected_logits(i)) for i in ids]


def _assert_same_greedy_path(got, ref, tol: float, min_equal: int) -> None:
    """Graph and eager runs pad batches differently, so logits differ by rounding and greedy paths may part at a
    near-tie. Compare the logits of every step up to and including the first differing token (their inputs are
    identical, so a real replay bug shows there as a large error), and require the paths to agree for long."""
    compared = 0
    for (tokens, logits), (ref_tokens, ref_logits) in zip(got, ref):
        same = next((i for i, (a, b) in enumerate(zip(tokens, ref_tokens)) if a != b),
                    min(len(tokens), len(ref_tokens)))
        rows = min(logits.shape[0] - len(tokens) + same + 1, logits.shape[0], ref_logits.shape[0])
        err = (logits[:rows].float() - ref_logits[:rows].float()).abs().max().item()
        assert err < tol, f'graph vs eager logits differ by {err} (first differing token at {same})'
        compared += same
    assert compared >= min_equal, f'greedy paths parted too early ({compared} equal tokens in all)'


@pytest.mark.gpu
@pytest.mark.parametrize('arch,dtype', [('qwen3', 'float32'), ('qwen3_next', 'float32')])
@pytest.mark.parametrize('prefix_caching', [False, True])
def test_cuda_graphs_match_eager(tiny_model_factory, arch, dtype, prefix_caching):
    # Staggered arrivals with 48-token prefill chunks: decode batches of changing size replay decode graphs, and
    # small prefills / mixed batches of fewer than 8 sequences replay prefill graphs (pad sequence + empty ones)
    # where the policy allows them (dense models; hybrids on fla, i.e. bf16, which
    # test_hybrid_prefill_graphs_match_eager covers).
    from lmdeploy.pytorch.backends import cuda as cuda_backend
    path = tiny_model_factory(arch)
    g = torch.Generator().manual_seed(3)
    shared = torch.randint(0, 1000, (21,), generator=g).tolist()
    prompts = [shared + torch.randint(0, 1000, (n,), generator=g).tolist() for n in (1, 5, 9, 14, 30, 2, 7)]
    common = dict(device_type='cuda', dtype=dtype, block_size=16, kernel_block_size=8, num_gpu_blocks=128,
                  max_batch_size=8, max_prefill_token_num=48, enable_prefix_caching=prefix_caching)
    graphs = Engine(path, PytorchEngineConfig(**common))
    eager = Engine(path, PytorchEngineConfig(eager_mode=True, **common))
    assert eager.agent.graph_runner is None
    got = _generate(graphs, prompts, max_new_tokens=40, stagger=3)
    ref = _generate(eager, prompts, max_new_tokens=40, stagger=3)
    runner = graphs.agent.graph_runner
    assert runner.num_replays > 20 and len(runner.graphs) >= 3, (runner.num_replays, sorted(runner.graphs))
    prefill_graphs = cuda_backend.prefill_graphs_supported(getattr(torch, dtype), is_hybrid=arch != 'qwen3')
    assert (runner.num_prefill_replays > 0) == prefill_graphs, runner.num_prefill_replays
    # float32: a replay bug shows as an O(1) logit error; 2e-2 leaves room for GEMM kernels that differ between
    # padded and unpadded shapes. bf16 rounding is coarser.
    _assert_same_greedy_path(got, ref, tol=2e-2 if dtype == 'float32' else 0.1, min_equal=60)


@pytest.mark.gpu
@pytest.mark.parametrize('prefix_caching', [False, True])
def test_hybrid_prefill_graphs_match_eager(tiny_model_factory, prefix_caching):
    """Hybrid prefill graphs (bf16, fla): small prefills and mixed batches replay graphs with fla's chunked
    kernel inside (as eager prefills run it), and generation follows eager mode."""
    path = tiny_model_factory('qwen3_next')
    g = torch.Generator().manual_seed(5)
    shared = torch.randint(0, 1000, (21,), generator=g).tolist()
    prompts = [shared + torch.randint(0, 1000, (n,), generator=g).tolist() for n in (1, 5, 9, 14, 30, 2, 7)]
    common = dict(device_type='cuda', dtype='bfloat16', block_size=16, kernel_block_size=8, num_gpu_blocks=128,
                  max_batch_size=8, max_prefill_token_num=48, enable_prefix_caching=prefix_caching)
    graphs = Engine(path, PytorchEngineConfig(**common))
    got = _generate(graphs, prompts, max_new_tokens=40, stagger=3)
    ref = _generate(Engine(path, PytorchEngineConfig(eager_mode=True, **common)), prompts, max_new_tokens=40,
                    stagger=3)
    assert graphs.agent.graph_runner.num_prefill_replays > 0
    _assert_same_greedy_path(got, ref, tol=0.1, min_equal=60)


@pytest.mark.gpu
def test_cuda_graph_bf16_long_decode_crosses_pages(tiny_model_factory):
    """bf16 (fla recurrent kernel), decodes that cross many KV pages after capture: graphs replay the same tokens
    as eager mode."""
    path = tiny_model_factory('qwen3_5')
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 1000, (n,), generator=g).tolist() for n in (3, 17, 40)]
    common = dict(device_type='cuda', dtype='bfloat16', block_size=16, kernel_block_size=8, num_gpu_blocks=128,
                  max_batch_size=4)
    got = _generate(Engine(path, PytorchEngineConfig(**common)), prompts, max_new_tokens=100)
    ref = _generate(Engine(path, PytorchEngineConfig(eager_mode=True, **common)), prompts, max_new_tokens=100)
    _assert_same_greedy_path(got, ref, tol=0.1, min_equal=100)


def test_static_inputs_prefill_padding():
    """A prefill bucket: real sequences, then one pad sequence with the pad tokens, then empty sequences."""
    static = _StaticInputs(max_tokens=32, max_seqs=8, max_pages=6, device=torch.device('cpu'))
    static.fill_decode(_decode_inputs(7, 6), 8)   # leave non-padding values behind
    inputs = _prefill_inputs([5, 9], kv_lens=[8, 20])
    key = GraphKey(16, 4, False)
    static.fill_prefill(inputs, key)
    view = static.view(key)
    assert view.input_ids.tolist() == list(range(1, 15)) + [0, 0]
    assert view.slot_mapping.tolist()[12:] == [52, 53, -1, -1]
    assert view.q_lens.tolist() == [5, 9, 2, 0] and view.kv_lens.tolist() == [8, 20, 2, 0]
    assert view.cu_seqlens_q.tolist() == [0, 5, 14, 16, 16]
    assert view.state_ids.tolist() == [2, 3, 0, 0] and view.is_fresh.tolist() == [False, False, True, True]
    assert view.use_recurrent_kernel and view.max_seqlen_q == 16 and not view.is_decode
    assert view.graph_chunk_indices is None   # no chunk-index buffer: the token-by-token kernel
    assert inputs.host_lens_exact and not view.host_lens_exact  # the view's host lists are placeholders
    # and back to a decode batch: sequence buffers are reset to one token per row
    static.fill_decode(_decode_inputs(3, 2), 4)
    view = static.view(GraphKey(4, 4, True))
    assert view.q_lens.tolist() == [1, 1, 1, 1] and view.cu_seqlens_q.tolist() == [0, 1, 2, 3, 4]
    assert view.kv_lens.tolist() == [11, 12, 13, 0] and view.is_fresh.tolist() == [False] * 4


def _prefill_inputs(lens: list[int], kv_lens: list[int] | None = None) -> ModelInputs:
    """A prefill batch; the first sequence continues from its slot when it has history (kv_len > q_len)."""
    total, kv_lens = sum(lens), kv_lens or list(lens)
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    return ModelInputs(
        input_ids=torch.arange(total) + 1, position_ids=torch.arange(total) + 3, q_lens=torch.tensor(lens),
        kv_lens=torch.tensor(kv_lens), cu_seqlens_q=torch.tensor(cu),
        block_tables=torch.arange(len(lens) * 3).view(len(lens), 3) + 1, slot_mapping=torch.arange(total) + 40,
        logits_indices=torch.tensor(cu[1:]) - 1, state_ids=torch.arange(len(lens)) + 2,
        is_fresh=torch.tensor([q == kv for q, kv in zip(lens, kv_lens)]), q_lens_list=lens, kv_lens_list=kv_lens,
        max_seqlen_q=max(lens), max_seqlen_k=max(kv_lens))


def _reference_chunk_rows(lens: list[int], chunk: int = 64) -> list[list[int]]:
    """(sequence, chunk within it) for every chunk of every sequence, by a plain loop."""
    return [[i, c] for i, n in enumerate(lens) for c in range(-(-n // chunk))]


def test_static_inputs_fill_padded_chunk_indices():
    """Hybrids on fla: the graph's chunk indices are the real sequences' chunks (pad sequence included), in order,
    then rows naming chunk 0 of the last, empty sequence, up to the bucket's fixed row count; a smaller batch
    after a larger one leaves no stale row in its view."""
    from lmdeploy.pytorch.kernels.cuda.gated_delta_rule import max_graph_chunks
    static = _StaticInputs(max_tokens=512, max_seqs=8, max_pages=6, device=torch.device('cpu'),
                           max_chunks=max_graph_chunks(512, 8))
    static.fill_prefill(_prefill_inputs([200, 130, 1, 64, 65]), GraphKey(512, 8, False))
    for lens, key in (([100, 9], GraphKey(128, 4, False)), ([63, 65, 128], GraphKey(512, 8, False)),
                      ([256], GraphKey(256, 4, False))):
        static.fill_prefill(_prefill_inputs(lens), key)
        view = static.view(key)
        pad = key.num_tokens - sum(lens)
        want = _reference_chunk_rows(lens + [pad])
        rows = max_graph_chunks(key.num_tokens, key.num_seqs)
        want += [[key.num_seqs - 1, 0]] * (rows - len(want))
        assert view.graph_chunk_indices.tolist() == want, (lens, key)
        assert not view.use_recurrent_kernel
        assert view.q_lens.tolist()[key.num_seqs - 1] == 0   # the padding rows' sequence is empty
    assert static.view(GraphKey(8, 8, True)).graph_chunk_indices is None   # decode graphs: token by token


def test_max_graph_chunks_is_the_tight_bound():
    """No split of T tokens into at most S - 1 sequences has more chunks than `max_graph_chunks(T, S)`, and some
    split has exactly that many (so the padded grid is never too small and not larger than it must be)."""
    import itertools

    from lmdeploy.pytorch.kernels.cuda.gated_delta_rule import max_graph_chunks
    for tokens, seqs, chunk in itertools.product((1, 5, 16, 63, 64, 65, 130), (2, 3, 4, 6), (4, 64)):
        best = 0
        for parts in itertools.product(range(tokens + 1), repeat=min(seqs - 1, 3)):
            if sum(parts) == tokens:
                best = max(best, sum(-(-n // chunk) for n in parts))
        if seqs - 1 <= 3:
            assert max_graph_chunks(tokens, seqs, chunk) == best, (tokens, seqs, chunk)
        else:
            assert max_graph_chunks(tokens, seqs, chunk) >= best


def test_padded_chunk_indices_refuse_a_non_empty_pad_sequence():
    from lmdeploy.pytorch.kernels.cuda.gated_delta_rule import padded_chunk_indices_host
    assert padded_chunk_indices_host([65, 0, 3], 5, pad_seq=1).tolist() == [[0, 0], [0, 1], [2, 0], [1, 0], [1, 0]]
    with pytest.raises(AssertionError, match='not empty'):
        padded_chunk_indices_host([65, 3], 5, pad_seq=1)
    with pytest.raises(AssertionError, match='do not fit'):
        padded_chunk_indices_host([65, 3], 2, pad_seq=2)


def _attention_table_reads(view: ModelInputs, kbs: int) -> list[tuple[int, int]]:
    """(row, column) of every block-table entry the paged attention kernels read for `view`: sequence b reads
    columns `[0, ceil(kv_lens[b] / kbs))` of row b (prefill: keys `[0, kv_len)`; decode: the same)."""
    return [(b, c) for b, kv_len in enumerate(view.kv_lens.tolist()) for c in range(-(-kv_len // kbs))]


@pytest.mark.parametrize('max_pages,kbs', [(32, 16), (8, 8), (1024, 8)], ids=['fp8-test', 'short', 'long'])
def test_pad_sequence_reads_stay_in_its_zeroed_block_table_row(max_pages, kbs):
    """The pad sequence of a prefill bucket attends to its own `Tg - T` keys: every block-table entry attention
    reads, for every warm-up key and for real batches after stale ones, lies inside its sequence's row of the
    buffer, and the pad / empty rows name page 0 (an existing page). A 4096-token bucket with a table only
    `max_pages` (the session's pages) wide read past the buffer: the H200's illegal memory accesses."""
    from lmdeploy.pytorch.engine.cuda_graph import CUDAGraphRunner, prefill_warm_keys
    runner = CUDAGraphRunner(None, None, max_batch_size=4, max_pages=max_pages, device=torch.device('cpu'),
                             max_prefill_tokens=4096, kernel_block_size=kbs)
    static = runner.static
    width = static.block_tables.size(1)
    stale = dataclasses.replace(_decode_inputs(4, max_pages), block_tables=torch.full((4, max_pages), 7))
    cases = [(None, key) for key in prefill_warm_keys(runner.token_buckets, runner.seq_buckets)]
    cases += [(batch, runner.key_of(batch)) for batch in (_prefill_inputs([5, 9]), _prefill_inputs([2049]))]
    for inputs, key in cases:
        static.fill_decode(stale, 4)   # stale page ids everywhere
        if inputs is not None:
            inputs = dataclasses.replace(inputs, block_tables=inputs.block_tables[:, :min(3, max_pages)])
        static.fill_prefill(inputs, key)
        view = static.view(key)
        b = 0 if inputs is None else inputs.batch_size
        for row, col in _attention_table_reads(view, kbs):
            assert col < width, f'{key}: row {row} reads column {col} of a {width}-wide table'
            if row >= b:
                page = view.block_tables[row, col].item()
                assert page == 0, f'{key}: pad row {row} names page {page}'
        pad_pages = -(-(key.num_tokens - (0 if inputs is None else inputs.input_ids.numel())) // kbs)
        assert (b, pad_pages - 1) in _attention_table_reads(view, kbs)   # the pad sequence does read that far


def test_graph_keys():
    from lmdeploy.pytorch.engine.cuda_graph import CUDAGraphRunner
    runner = CUDAGraphRunner(None, None, max_batch_size=40, max_pages=6, device=torch.device('cpu'),
                             max_prefill_tokens=300)
    assert runner.token_buckets == (16, 32, 64, 128, 256, 384)
    assert runner.key_of(_decode_inputs(3, 2)) == GraphKey(4, 4, True)
    assert runner.key_of(_decode_inputs(33, 2)) == GraphKey(40, 40, True)
    assert runner.key_of(_decode_inputs(3, 7)) is None            # wider block table than the buffers
    prefill = dataclasses.replace(_decode_inputs(3, 2), input_ids=torch.zeros(70, dtype=torch.int64),
                                  max_seqlen_q=60)
    assert runner.key_of(prefill) == GraphKey(128, 8, False)       # 3 sequences + pad + one empty
    assert runner.key_of(dataclasses.replace(prefill, input_ids=torch.zeros(300, dtype=torch.int64))) == \
        GraphKey(384, 8, False)
    assert runner.key_of(dataclasses.replace(prefill, input_ids=torch.zeros(385, dtype=torch.int64))) is None
    mixed = dataclasses.replace(_decode_inputs(39, 2), input_ids=torch.zeros(60, dtype=torch.int64), max_seqlen_q=9)
    assert runner.key_of(mixed) == GraphKey(64, 42, False)         # a full batch: sequence bucket 40 + 2
    small = dataclasses.replace(_decode_inputs(20, 2), input_ids=torch.zeros(30, dtype=torch.int64), max_seqlen_q=9)
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
    one, two = _prefill_inputs([20]), _prefill_inputs([100])
    assert runner.key_of(one) == GraphKey(32, 4, False)
    runner.failed.add(GraphKey(32, 4, False))
    assert runner.key_of(one) is None
    runner.graphs[GraphKey(128, 4, False)] = (None, None)          # one prefill graph: the limit
    assert runner.key_of(two) == GraphKey(128, 4, False)           # captured keys still replay
    assert runner.key_of(_prefill_inputs([40])) is None            # new ones run eagerly
    assert runner.key_of(_decode_inputs(3, 2)) == GraphKey(4, 4, True)


# ------------------------------------------------------------------------------------------ prefill graphs (GPU)
# Tiny hybrids (3 gated DeltaNet : 1 attention; Qwen3.5 with a dense MLP, Qwen3-Next with MoE) with prefills up to
# 4096 tokens in one forward: graphs (warm start) against eager mode, same weights, prefix caching on. One pair of
# engines per (arch, dtype) for the whole module.
BUCKET_EDGE_LENS = [255, 256, 257, 767, 1024, 1025, 1536, 2049, 3583, 4095, 4096]


@pytest.fixture(scope='module', params=[('qwen3_5', 'bfloat16'), ('qwen3_5', 'float16'), ('qwen3_next', 'bfloat16')],
                ids=lambda p: '-'.join(p))
def hybrid_pair(request, tiny_model_factory):
    if not torch.cuda.is_available():
        pytest.skip('needs CUDA')
    pytest.importorskip('fla')
    arch, dtype = request.param
    path = tiny_model_factory(arch, max_position_embeddings=8192)
    common = dict(device_type='cuda', dtype=dtype, block_size=16, kernel_block_size=8, num_gpu_blocks=1536,
                  max_batch_size=8, max_prefill_token_num=4096, session_len=8192, enable_prefix_caching=True)
    start = time.perf_counter()
    graphs = Engine(path, PytorchEngineConfig(**common))
    startup = time.perf_counter() - start
    eager = Engine(path, PytorchEngineConfig(eager_mode=True, **common))
    return graphs, eager, dtype, startup, path


@pytest.fixture(scope='module')
def float32_truth(hybrid_pair):
    """The same checkpoint eagerly in float32 on CUDA (the exact torch gated delta rule): the yardstick for bf16 /
    fp16 rounding."""
    *_, path = hybrid_pair
    return Engine(path, PytorchEngineConfig(device_type='cuda', dtype='float32', block_size=16, kernel_block_size=8,
                                            num_gpu_blocks=1536, max_batch_size=8, max_prefill_token_num=4096,
                                            session_len=8192, eager_mode=True))


def _prompts(lens: list[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 1000, (n,), generator=g).tolist() for n in lens]


@pytest.mark.gpu
def test_warm_start_captures_every_prefill_bucket(hybrid_pair):
    """At start-up: decode graphs and one prefill graph per token bucket (one or two sequences), within a start-up
    that stays short for this tiny model."""
    from lmdeploy.pytorch.engine.cuda_graph import PREFILL_TOKEN_BUCKETS, prefill_warm_keys
    graphs, _, _, startup, _ = hybrid_pair
    runner = graphs.agent.graph_runner
    assert runner.token_buckets == PREFILL_TOKEN_BUCKETS
    warm = set(prefill_warm_keys(runner.token_buckets, runner.seq_buckets))
    assert warm <= set(runner.graphs) and not runner.failed
    assert runner.static.chunk_indices is not None   # hybrids on fla: the chunked kernel inside the graphs
    assert 0 < runner.capture_seconds < startup < 300


def _rms(x: torch.Tensor) -> float:
    return x.float().pow(2).mean().sqrt().item()


@pytest.mark.gpu
def test_prefills_at_bucket_edges_replay_warm_graphs_like_eager(hybrid_pair, float32_truth):
    """Lone prompts just below, at and above each bucket edge up to 4096 tokens: every prefill replays a graph
    captured at start-up (no capture on the request path).

    A prompt that fills its bucket runs the very kernels on the very shapes eager mode runs (no pad token), so its
    logits and tokens equal eager's (1e-2). A padded one runs GEMMs and MoE tiles of other row counts, whose bf16 /
    fp16 rounding differs; in the tiny MoE model that flips router near-ties at a few positions (whole rows of
    logits then differ by ~1, as between any two segmentations; see test_cuda_engine). So there: at most 1% of
    the prompt positions may differ from eager by more than 0.1, and the logits must be no further (RMS) from the
    float32 run than eager's are (2x margin). A replay bug (wrong state, KV or chunk indices) breaks every one."""
    graphs, eager, dtype, _, _ = hybrid_pair
    runner = graphs.agent.graph_runner
    captured, replays = set(runner.graphs), runner.num_prefill_replays
    report = {}
    for i, prompt in enumerate(_prompts(BUCKET_EDGE_LENS, seed=11)):
        got = _generate(graphs, [prompt], max_new_tokens=4)
        ref = _generate(eager, [prompt], max_new_tokens=4)
        n = len(prompt)
        assert runner.num_prefill_replays == replays + i + 1, f'prompt of {n} tokens ran eagerly'
        if n in runner.token_buckets:
            _assert_same_greedy_path(got, ref, tol=1e-2, min_equal=4)
            continue
        truth = _generate(float32_truth, [prompt], max_new_tokens=1)[0][1][:n].float()
        graph_rows, eager_rows = got[0][1][:n].float(), ref[0][1][:n].float()   # teacher-forced prompt positions
        far = ((graph_rows - eager_rows).abs().amax(dim=-1) > 0.1).sum().item()
        graph_rms, eager_rms = _rms(graph_rows - truth), _rms(eager_rows - truth)
        report[n] = f'{far} positions > 0.1 from eager; RMS vs fp32 graph {graph_rms:.3g}, eager {eager_rms:.3g}'
        assert far <= max(2, n // 100), f'{n} tokens: {report[n]}'
        assert graph_rms <= 2 * eager_rms + 1e-3, f'{n} tokens: {report[n]}'
    print(f'{dtype} bucket edges: {report}')
    assert set(runner.graphs) == captured


@pytest.mark.gpu
def test_batched_and_mixed_prefills_replay_like_eager(hybrid_pair):
    """Several prompts in one forward and staggered arrivals (prefill chunks beside decodes), up to 4096 tokens a
    forward: graphs captured on first use, then replayed, follow eager mode."""
    graphs, eager, _, _, _ = hybrid_pair
    runner = graphs.agent.graph_runner
    prompts = _prompts([700, 300, 1500, 64, 9, 2000, 130], seed=12)
    for stagger in (0, 2):
        got = _generate(graphs, prompts, max_new_tokens=12, stagger=stagger)
        ref = _generate(eager, prompts, max_new_tokens=12, stagger=stagger)
        _assert_same_greedy_path(got, ref, tol=0.1, min_equal=60)
    assert any(not k.decode and k.num_seqs >= 8 for k in runner.graphs)
    assert not runner.failed


def _generate_counting_hits(engine: Engine, prompt: list[int], max_new_tokens: int):
    cached, out = [], []
    seq_id = engine.add_request(prompt, SamplingParams(max_new_tokens=max_new_tokens), collect_logits=True,
                                callback=lambda o: (cached.append(o.num_cached), out.extend(o.new_token_ids)))
    while engine.has_work:
        engine.step()
    engine.check_integrity()
    return out, engine.pop_collected_logits(seq_id), max(cached)


@pytest.mark.gpu
def test_prefix_hit_with_unaligned_restore_replays_like_eager(hybrid_pair):
    """A 1000-token prompt (not block-aligned: its state checkpoint is at the prompt end), then that prompt plus
    300 tokens: the second request restores KV and state from the cache and prefills only the suffix through a
    graph (history longer than the bucket); tokens and logits follow eager mode, which restores the same way."""
    graphs, eager, _, _, _ = hybrid_pair
    prefix, suffix = _prompts([1000, 300], seed=13)
    results = []
    for engine in (graphs, eager):
        _generate_counting_hits(engine, prefix, 1)
        tokens, logits, cached = _generate_counting_hits(engine, prefix + suffix, 8)
        assert cached >= 992, cached   # a hit at (or after) the last full block
        results.append([(tokens, logits)])
    _assert_same_greedy_path(results[0], results[1], tol=0.1, min_equal=7)


@pytest.mark.gpu
def test_state_after_a_graph_prefill_equals_eager(hybrid_pair):
    """One packed prefill of three fresh sequences through `ModelAgent.forward_logits`: the graph engine runs it
    twice (on first use of its key: eager through the static buffers, then capture; then replay) and leaves the
    same logits and the same recurrent and conv state in the sequences' pool rows as the eager engine."""
    from lmdeploy.pytorch.messages import SchedulerSequence
    graphs, eager, dtype, _, _ = hybrid_pair
    results = []
    for engine, runs in ((graphs, 2), (eager, 1)):
        prompts = _prompts([300, 5, 1000], seed=14)
        seqs = [SchedulerSequence(seq_id=10_000 + i, token_ids=list(p), num_prompt_tokens=len(p),
                                  sampling=SamplingParams(max_new_tokens=1)) for i, p in enumerate(prompts)]
        for seq in seqs:
            engine.scheduler.add(seq)
        sched = engine.scheduler.schedule()
        assert sched.num_new_tokens == [len(p) for p in prompts]
        inputs, _ = engine.inputs_maker.make(sched)
        runner = engine.agent.graph_runner
        replays = runner.num_prefill_replays if runner else 0
        # an earlier test of the module may have captured this key already: then both runs replay
        first_use = runner is not None and runner.key_of(inputs) not in runner.graphs
        for _ in range(runs):
            logits, _ = engine.agent.forward_logits(inputs)
        if runs == 2:
            assert runner.num_prefill_replays == replays + runs - first_use
        rows = inputs.state_ids.tolist()
        states = [{name: pool[rows].float().cpu() for name, pool in layer.items()}
                  for layer in engine.cache_engine.state_caches]
        results.append((logits.float(), states))
        for seq in seqs:
            engine.scheduler.abort(seq)
        engine.check_integrity()
    (got_logits, got_states), (want_logits, want_states) = results
    torch.testing.assert_close(got_logits, want_logits, atol=0.1, rtol=0.05)
    for got, want in zip(got_states, want_states):
        for name in want:
            torch.testing.assert_close(got[name], want[name], atol=5e-2, rtol=5e-2, msg=name)
