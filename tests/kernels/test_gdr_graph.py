"""fla's chunked gated delta rule inside a CUDA graph (`kernels/cuda/gated_delta_rule.py`, static padded chunk
indices): one capture per bucket replays batches of other lengths exactly like an eager call on the unpadded
batch, and the static path never synchronises; two layers of one captured forward share one view of the static
``cu_seqlens`` (fla derives its chunk offsets once, inside the graph, and both layers read them on every replay's
lengths). CPU: the wrapper hands fla the view it is given, checked with a recording stand-in for fla."""
from __future__ import annotations

import sys
import types

import pytest
import torch

from lmdeploy.pytorch.kernels.cuda import gated_delta_rule as cuda_gdr

HK, H, DK, DV = 2, 4, 64, 64
BUCKET_TOKENS, BUCKET_SEQS = 512, 8
# (lengths, fresh): just below / at / above chunk edges, several sequences, a batch that fills the bucket (the pad
# sequence is then empty), sequences continuing from their pool rows
CASES = [
    ([1], [True]),
    ([63], [False]),
    ([64], [True]),
    ([65], [False]),
    ([100, 9, 64], [True, False, True]),
    ([128, 129, 127, 1, 64, 63], [False, True, False, True, False, True]),
    ([512], [False]),
    ([255, 257], [True, False]),
]


def test_cu_seqlens_view_is_the_object_fla_gets(monkeypatch):
    """`cu_seqlens_view` is what fla receives for ``cu_seqlens`` (its identity is fla's memo key: one view per
    forward, shared by the forward's layers); without it, the caller's object; a tensor that does not view the
    buffer is refused."""
    seen = []

    def fake_chunk(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                   cu_seqlens, chunk_indices=None):
        seen.append((cu_seqlens, chunk_indices))
        return v.clone(), initial_state.clone()
    module = types.ModuleType('fla.ops.gated_delta_rule')
    module.chunk_gated_delta_rule = fake_chunk
    for name in ('fla', 'fla.ops'):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, 'fla.ops.gated_delta_rule', module)
    q, k = torch.randn(10, HK, 8, dtype=torch.bfloat16), torch.randn(10, HK, 8, dtype=torch.bfloat16)
    v, beta, g = torch.randn(10, H, 8, dtype=torch.bfloat16), torch.rand(10, H), -torch.rand(10, H)
    cu, pool = torch.tensor([0, 4, 10, 10]), torch.zeros(4, H, 8, 8)
    ids, fresh = torch.tensor([1, 2, 0]), torch.tensor([True, True, True])
    indices = cuda_gdr.padded_chunk_indices_host([4, 6, 0], 3, pad_seq=2)
    view = cu.view(-1)
    for cu_view in (view, view, None):
        cuda_gdr.chunk_gated_delta_rule(q, k, v, g, beta, cu, pool, ids, fresh, chunk_indices=indices,
                                        cu_seqlens_view=cu_view)
    (a, ia), (b, _), (c, _) = seen
    assert a is view and b is view and c is cu
    assert ia is indices
    with pytest.raises(AssertionError, match='view the cu_seqlens buffer'):
        cuda_gdr.chunk_gated_delta_rule(q, k, v, g, beta, cu, pool, ids, fresh, chunk_indices=indices,
                                        cu_seqlens_view=cu.clone())


@pytest.mark.parametrize('once', [True, False])
def test_forward_memo_builds_once_per_forward_and_apart_inside_a_capture(monkeypatch, once):
    """`backends/cuda.forward_memo`: eager calls of one forward share one build; a capture on the same inputs (the
    graph runner's warm-up, then its capture) builds its own, never the eager one, and with
    `LMDEPLOY_GRAPH_INDEX_ONCE` shares it between its layers (else builds at every call); CPU tensors never ask
    whether a capture runs."""
    from lmdeploy.pytorch.backends import cuda as cuda_backend
    from lmdeploy.pytorch.model_inputs import ModelInputs
    monkeypatch.setattr(cuda_backend, '_INDEX_ONCE', once)
    capturing = [False]
    monkeypatch.setattr(torch.cuda, 'is_current_stream_capturing', lambda: capturing[0])
    zeros = torch.zeros(2, dtype=torch.int64)
    inputs = ModelInputs(input_ids=zeros, position_ids=zeros, q_lens=zeros[:1], kv_lens=zeros[:1],
                         cu_seqlens_q=zeros, block_tables=zeros.view(1, 2), slot_mapping=zeros,
                         logits_indices=zeros, state_ids=zeros[:1], is_fresh=zeros[:1].bool(), q_lens_list=[2],
                         kv_lens_list=[2], max_seqlen_q=2, max_seqlen_k=2)
    builds = []

    def build():
        builds.append(object())
        return builds[-1]
    cuda = torch.device('cuda')
    eager = [cuda_backend.forward_memo(inputs, cuda, 'k', build) for _ in range(3)]
    assert len(builds) == 1 and all(b is builds[0] for b in eager)
    capturing[0] = True
    captured = [cuda_backend.forward_memo(inputs, cuda, 'k', build) for _ in range(3)]
    assert builds[0] not in captured
    assert len(builds) == (2 if once else 4) and captured[-1] is builds[-1]
    assert (captured[0] is captured[2]) == once
    cpu = [cuda_backend.forward_memo(inputs, torch.device('cpu'), 'k', build) for _ in range(2)]
    assert cpu[0] is cpu[1] is eager[0]  # off CUDA nothing is captured: the eager memo


class _StaticBatch:
    """Static device buffers of one graph bucket, filled like `engine/cuda_graph.py` fills them."""

    def __init__(self, gen: torch.Generator):
        t, s = BUCKET_TOKENS, BUCKET_SEQS
        self.q = torch.zeros(t, HK, DK, device='cuda', dtype=torch.bfloat16)
        self.k = torch.zeros_like(self.q)
        self.v = torch.zeros(t, H, DV, device='cuda', dtype=torch.bfloat16)
        self.g = torch.zeros(t, H, device='cuda')
        self.beta = torch.zeros(t, H, device='cuda', dtype=torch.bfloat16)
        self.cu = torch.zeros(s + 1, dtype=torch.int64, device='cuda')
        self.ids = torch.zeros(s, dtype=torch.int64, device='cuda')
        self.fresh = torch.ones(s, dtype=torch.bool, device='cuda')
        self.indices = torch.zeros(cuda_gdr.max_graph_chunks(t, s), 2, dtype=torch.int64, device='cuda')
        self.pool = torch.zeros(12, H, DK, DV, device='cuda')
        self.gen = gen

    def fill(self, data, lens, slots, fresh) -> None:
        t, s = BUCKET_TOKENS, BUCKET_SEQS
        n = sum(lens)
        for buf, x in zip((self.q, self.k, self.v, self.g, self.beta), data):
            buf[:n].copy_(x)
            buf[n:].copy_(torch.randn(buf[n:].shape, generator=self.gen).to(buf) * 30)  # loud pad tokens
        all_lens = lens + [t - n] + [0] * (s - len(lens) - 1)
        self.cu.copy_(torch.tensor([0] + all_lens).cumsum(0))
        self.ids.copy_(torch.tensor(slots + [0] * (s - len(lens))))
        self.fresh.copy_(torch.tensor(fresh + [True] * (s - len(lens))))
        self.indices.copy_(cuda_gdr.padded_chunk_indices_host(lens + [t - n], self.indices.shape[0], pad_seq=s - 1))

    def run(self, cu_view: torch.Tensor | None = None) -> torch.Tensor:
        """One layer's call; `cu_view`: the forward's view of the static cu_seqlens (a new one when None)."""
        return cuda_gdr.chunk_gated_delta_rule(self.q, self.k, self.v, self.g, self.beta, self.cu, self.pool,
                                               self.ids, self.fresh, chunk_indices=self.indices,
                                               cu_seqlens_view=self.cu.view(-1) if cu_view is None else cu_view)


def _case_data(lens, gen):
    n = sum(lens)
    q, k = (torch.randn(n, HK, DK, generator=gen).to('cuda', torch.bfloat16) for _ in range(2))
    v = torch.randn(n, H, DV, generator=gen).to('cuda', torch.bfloat16)
    g = torch.nn.functional.logsigmoid(torch.randn(n, H, generator=gen) + 2).cuda()
    beta = torch.rand(n, H, generator=gen).to('cuda', torch.bfloat16)
    return q, k, v, g, beta


def _reference(data, lens, slots, fresh, pool):
    """fla eagerly on the unpadded batch, with its exact chunk indices."""
    out = cuda_gdr.chunk_gated_delta_rule(
        *data, torch.tensor([0] + lens).cumsum(0).cuda(), pool, torch.tensor(slots).cuda(),
        torch.tensor(fresh).cuda(), chunk_indices=cuda_gdr.chunk_indices_host(lens).cuda())
    return out, pool


@pytest.mark.gpu
@pytest.mark.parametrize('layers', [1, 2])
def test_chunked_gdr_in_a_cuda_graph_replays_new_lengths_like_eager(layers):
    pytest.importorskip('fla')
    gen = torch.Generator().manual_seed(0)
    static = _StaticBatch(gen)
    initial = torch.randn(12, H, DK, DV, generator=gen).cuda() * 0.1
    initial[0] = float('nan')  # the dummy row: pad and empty sequences are fresh, so it must never be read

    def prepare(case):
        lens, fresh = case
        slots = list(range(1, len(lens) + 1))
        data = _case_data(lens, gen)
        static.pool.copy_(initial)
        static.fill(data, lens, slots, fresh)
        return data, lens, slots, fresh

    data, lens, slots, fresh = prepare(CASES[-1])
    static.run()  # compile / autotune outside the checks
    for case in CASES[:2]:  # eager on the static buffers: no host synchronisation anywhere
        data, lens, slots, fresh = prepare(case)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode('error')
        try:
            out = static.run()
        finally:
            torch.cuda.set_sync_debug_mode('default')
        want, want_pool = _reference(data, lens, slots, fresh, initial.clone())
        torch.testing.assert_close(out[:sum(lens)], want, atol=0, rtol=0)
        torch.testing.assert_close(static.pool[1:len(lens) + 1], want_pool[1:len(lens) + 1], atol=0, rtol=0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        cu_view = static.cu.view(-1)  # the captured forward's own view, shared by its layers
        for _ in range(layers):  # a later layer reads the pool rows the one before wrote (its fresh rows: zeros)
            graph_out = static.run(cu_view)
    for case in CASES:
        data, lens, slots, fresh = prepare(case)
        graph.replay()
        torch.cuda.synchronize()
        want_pool = initial.clone()
        for _ in range(layers):
            want, want_pool = _reference(data, lens, slots, fresh, want_pool)
        n, used = sum(lens), slice(1, len(lens) + 1)
        torch.testing.assert_close(graph_out[:n], want, atol=1e-2, rtol=1e-2, msg=f'{lens}: outputs')
        torch.testing.assert_close(static.pool[used], want_pool[used], atol=1e-3, rtol=1e-3, msg=f'{lens}: states')
        assert torch.isfinite(graph_out[:n]).all() and torch.isfinite(static.pool[used]).all()
        untouched = slice(len(lens) + 1, 12)
        assert torch.equal(static.pool[untouched], initial[untouched]), f'{lens}: rows no sequence owns changed'
