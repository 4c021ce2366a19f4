"""CUDA-graph static inputs (CPU): the padding contract of decode and prefill buckets (pad rows the kernels ignore,
the pad sequence, padded chunk indices) and the block-table reads of the pad sequence."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from graph_inputs import decode_inputs, prefill_inputs

from lmdeploy.pytorch.engine.static_inputs import GraphKey, StaticInputs
from lmdeploy.pytorch.model_inputs import ModelInputs


def test_static_inputs_pad_rows_are_inert():
    """Rows past the batch must be padding the kernels ignore: kv_len 0, KV slot -1, dummy state row 0."""
    static = StaticInputs(max_tokens=8, max_seqs=8, max_pages=6, device=torch.device('cpu'))
    static.fill_decode(decode_inputs(7, 6), 8)     # a large batch first leaves non-padding values behind
    static.fill_decode(decode_inputs(3, 2), 4)
    view = static.view(GraphKey(4, 4, True))
    assert view.input_ids.tolist() == [100, 101, 102, 0]
    assert view.position_ids.tolist() == [10, 11, 12, 0]
    assert view.kv_lens.tolist() == [11, 12, 13, 0]
    assert view.slot_mapping.tolist() == [5, 69, 133, -1]
    assert view.state_ids.tolist() == [1, 2, 3, 0]
    assert view.block_tables[:3, :2].tolist() == [[1, 2], [3, 4], [5, 6]]
    assert view.cu_seqlens_q.tolist() == [0, 1, 2, 3, 4] and view.is_decode and view.batch_size == 4


def test_static_inputs_prefill_padding():
    """A prefill bucket: real sequences, then one pad sequence with the pad tokens, then empty sequences."""
    static = StaticInputs(max_tokens=32, max_seqs=8, max_pages=6, device=torch.device('cpu'))
    static.fill_decode(decode_inputs(7, 6), 8)   # leave non-padding values behind
    inputs = prefill_inputs([5, 9], kv_lens=[8, 20])
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
    static.fill_decode(decode_inputs(3, 2), 4)
    view = static.view(GraphKey(4, 4, True))
    assert view.q_lens.tolist() == [1, 1, 1, 1] and view.cu_seqlens_q.tolist() == [0, 1, 2, 3, 4]
    assert view.kv_lens.tolist() == [11, 12, 13, 0] and view.is_fresh.tolist() == [False] * 4


def _reference_chunk_rows(lens: list[int], chunk: int = 64) -> list[list[int]]:
    """(sequence, chunk within it) for every chunk of every sequence, by a plain loop."""
    return [[i, c] for i, n in enumerate(lens) for c in range(-(-n // chunk))]


def test_static_inputs_fill_padded_chunk_indices():
    """Hybrids on fla: the graph's chunk indices are the real sequences' chunks (pad sequence included), in order,
    then rows naming chunk 0 of the last, empty sequence, up to the bucket's fixed row count; a smaller batch
    after a larger one leaves no stale row in its view."""
    from lmdeploy.pytorch.kernels.cuda.gated_delta_rule import max_graph_chunks
    static = StaticInputs(max_tokens=512, max_seqs=8, max_pages=6, device=torch.device('cpu'),
                           max_chunks=max_graph_chunks(512, 8))
    static.fill_prefill(prefill_inputs([200, 130, 1, 64, 65]), GraphKey(512, 8, False))
    for lens, key in (([100, 9], GraphKey(128, 4, False)), ([63, 65, 128], GraphKey(512, 8, False)),
                      ([256], GraphKey(256, 4, False))):
        static.fill_prefill(prefill_inputs(lens), key)
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
    stale = dataclasses.replace(decode_inputs(4, max_pages), block_tables=torch.full((4, max_pages), 7))
    cases = [(None, key) for key in prefill_warm_keys(runner.token_buckets, runner.seq_buckets)]
    cases += [(batch, runner.key_of(batch)) for batch in (prefill_inputs([5, 9]), prefill_inputs([2049]))]
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
