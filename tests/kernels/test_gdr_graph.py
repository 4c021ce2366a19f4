"""fla's chunked gated delta rule inside a CUDA graph (`kernels/cuda/gated_delta_rule.py`, static padded chunk
indices): one capture per bucket replays batches of other lengths exactly like an eager call on the unpadded
batch, and the static path never synchronises. CPU: the wrapper hands fla a fresh ``cu_seqlens`` object per call
(fla memoises what it derives from it by identity), checked with a recording stand-in for fla."""
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


def test_cu_seqlens_in_place_hands_fla_a_fresh_object(monkeypatch):
    """With `cu_seqlens_in_place` every call passes fla a new tensor object with the same values (so fla's
    identity memo cannot return offsets derived on an earlier call's lengths); without it, the caller's object."""
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
    for in_place in (True, True, False):
        cuda_gdr.chunk_gated_delta_rule(q, k, v, g, beta, cu, pool, ids, fresh, chunk_indices=indices,
                                        cu_seqlens_in_place=in_place)
    (a, ia), (b, _), (c, _) = seen
    assert a is not cu and b is not cu and a is not b and c is cu
    assert a.tolist() == b.tolist() == cu.tolist() and a.data_ptr() == cu.data_ptr()
    assert ia is indices


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

    def run(self) -> torch.Tensor:
        return cuda_gdr.chunk_gated_delta_rule(self.q, self.k, self.v, self.g, self.beta, self.cu, self.pool,
                                               self.ids, self.fresh, chunk_indices=self.indices,
                                               cu_seqlens_in_place=True)


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
def test_chunked_gdr_in_a_cuda_graph_replays_new_lengths_like_eager():
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
        graph_out = static.run()
    for case in CASES:
        data, lens, slots, fresh = prepare(case)
        graph.replay()
        torch.cuda.synchronize()
        want, want_pool = _reference(data, lens, slots, fresh, initial.clone())
        n, used = sum(lens), slice(1, len(lens) + 1)
        torch.testing.assert_close(graph_out[:n], want, atol=1e-2, rtol=1e-2, msg=f'{lens}: outputs')
        torch.testing.assert_close(static.pool[used], want_pool[used], atol=1e-3, rtol=1e-3, msg=f'{lens}: states')
        assert torch.isfinite(graph_out[:n]).all() and torch.isfinite(static.pool[used]).all()
        untouched = slice(len(lens) + 1, 12)
        assert torch.equal(static.pool[untouched], initial[untouched]), f'{lens}: rows no sequence owns changed'
