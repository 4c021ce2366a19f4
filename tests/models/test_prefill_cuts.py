"""In-prefill state checkpoints (`ModelInputs.state_cuts`) at the nn level, on the default backend.

A forward with cuts must (a) return the same outputs and leave the same final states as one without, and (b) leave
in each cut's pool row exactly the state a separate forward over the tokens before the cut leaves: the recurrent
state, and the conv history (the last K-1 inputs, taken from the old history for a cut within K-1 tokens of the
segment start, zeros for a fresh sequence).
"""
from __future__ import annotations

import pytest
import torch

from lmdeploy.pytorch.backends.selector import use_backend
from lmdeploy.pytorch.model_inputs import ModelInputs, StateCuts
from lmdeploy.pytorch.nn.gated_delta import CausalConv1d, GatedDeltaRule

HK, H, DK, DV, C, K = 2, 4, 8, 6, 12, 4


def make_inputs(lens: list[int], slots: list[int], fresh: list[bool], cuts: StateCuts | None) -> ModelInputs:
    cu = torch.zeros(len(lens) + 1, dtype=torch.int64)
    cu[1:] = torch.tensor(lens).cumsum(0)
    total = int(cu[-1])
    return ModelInputs(
        input_ids=torch.zeros(total, dtype=torch.int64), position_ids=torch.zeros(total, dtype=torch.int64),
        q_lens=torch.tensor(lens), kv_lens=torch.tensor(lens), cu_seqlens_q=cu,
        block_tables=torch.zeros(len(lens), 1, dtype=torch.int64), slot_mapping=torch.zeros(total, dtype=torch.int64),
        logits_indices=torch.zeros(0, dtype=torch.int64), state_ids=torch.tensor(slots),
        is_fresh=torch.tensor(fresh), q_lens_list=lens, kv_lens_list=lens, max_seqlen_q=max(lens),
        max_seqlen_k=max(lens), state_cuts=cuts)


def cuts_of(rows, offsets, dsts, lens, slots, fresh) -> StateCuts:
    return StateCuts(rows=rows, offsets=offsets, slots=dsts, q_lens=lens, state_ids=slots, is_fresh=fresh)


# rows: (length, slot, fresh); cuts: (row, offset, destination slot). Offsets 1 and 2 are closer to the segment start
# than K-1 = 3, so their conv history mixes old history (or zeros when fresh) with new inputs.
CASES = [
    ([(70, 1, False)], [(0, 64, 5)]),
    ([(70, 1, True), (130, 2, False), (9, 3, False)], [(0, 1, 6), (0, 2, 7), (1, 64, 8), (1, 128, 9), (2, 5, 10)]),
    ([(5, 2, True), (40, 1, False)], [(1, 2, 4), (1, 33, 5), (0, 3, 6)]),
]


@pytest.mark.parametrize('rows, cuts', CASES)
def test_cuts_leave_prefix_states_and_change_nothing_else(rows, cuts):
    torch.manual_seed(0)
    lens = [n for n, _, _ in rows]
    slots = [s for _, s, _ in rows]
    fresh = [f for _, _, f in rows]
    total = sum(lens)
    with use_backend('default'):
        gdr = GatedDeltaRule()
        conv = CausalConv1d(C, K)
    conv.weight.data.normal_()
    q, k = torch.randn(total, HK, DK), torch.randn(total, HK, DK)
    v, beta = torch.randn(total, H, DV), torch.rand(total, H)
    g = -torch.rand(total, H)
    x = torch.randn(total, C)
    rec_pool, conv_pool = torch.randn(12, H, DK, DV), torch.randn(12, C, K - 1)

    def run(inputs, rec, cnv, x_=x, q_=q, k_=k, v_=v, g_=g, beta_=beta):
        return conv(x_, cnv, inputs), gdr(q_, k_, v_, g_, beta_, rec, inputs)

    plain_rec, plain_conv = rec_pool.clone(), conv_pool.clone()
    want_x, want_o = run(make_inputs(lens, slots, fresh, None), plain_rec, plain_conv)
    cut_rec, cut_conv = rec_pool.clone(), conv_pool.clone()
    stc = cuts_of([r for r, _, _ in cuts], [o for _, o, _ in cuts], [d for _, _, d in cuts], lens, slots, fresh)
    got_x, got_o = run(make_inputs(lens, slots, fresh, stc), cut_rec, cut_conv)
    torch.testing.assert_close(got_x, want_x)
    torch.testing.assert_close(got_o, want_o, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(cut_rec[slots], plain_rec[slots], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(cut_conv[slots], plain_conv[slots])
    starts = [sum(lens[:i]) for i in range(len(lens))]
    for row, offset, dst in cuts:
        # reference: a forward over the row's first `offset` tokens alone, from the original pool
        ref_rec, ref_conv = rec_pool.clone(), conv_pool.clone()
        sl = slice(starts[row], starts[row] + offset)
        run(make_inputs([offset], [slots[row]], [fresh[row]], None), ref_rec, ref_conv,
            x[sl], q[sl], k[sl], v[sl], g[sl], beta[sl])
        torch.testing.assert_close(cut_rec[dst], ref_rec[slots[row]], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(cut_conv[dst], ref_conv[slots[row]])
    untouched = set(range(12)) - set(slots) - {d for _, _, d in cuts}
    for slot in untouched:
        assert torch.equal(cut_rec[slot], rec_pool[slot]) and torch.equal(cut_conv[slot], conv_pool[slot])


@pytest.mark.gpu
@pytest.mark.parametrize('with_cuts', [False, True], ids=['plain', 'cuts'])
def test_cuda_prefill_layers_never_synchronise(with_cuts):
    """A bf16 prefill through the conv and the gated delta rule (fla) on the cuda backend, in-prefill cuts or not,
    queues its work without waiting for the device: no index upload from pageable memory, no length read back.
    Any synchronising op raises under torch's sync debug mode. The cuts still leave the plain forward's output."""
    pytest.importorskip('fla')
    torch.manual_seed(0)
    lens, slots, fresh = [200, 70, 130], [1, 2, 3], [True, False, False]
    cuts = [(0, 64, 5), (0, 128, 6), (2, 3, 7), (2, 64, 8)] if with_cuts else []
    hk, h, dk, dv = 2, 4, 64, 64
    total = sum(lens)
    with use_backend('cuda'):
        gdr = GatedDeltaRule()
        conv = CausalConv1d(C, K)
    conv.cuda().weight.data.normal_()
    q, k = torch.randn(total, hk, dk), torch.randn(total, hk, dk)
    v, beta, g = torch.randn(total, h, dv), torch.rand(total, h), -torch.rand(total, h)
    q, k, v, beta = (t.cuda().bfloat16() for t in (q, k, v, beta))
    g, x = g.cuda(), torch.randn(total, C, device='cuda', dtype=torch.bfloat16)
    rec_pool = torch.randn(12, h, dk, dv, device='cuda') * 0.1
    conv_pool = torch.randn(12, C, K - 1, device='cuda', dtype=torch.bfloat16)

    def forward(cut_list):
        stc = cuts_of([r for r, _, _ in cut_list], [o for _, o, _ in cut_list], [d for _, _, d in cut_list],
                      lens, slots, fresh) if cut_list else None
        inputs = make_inputs(lens, slots, fresh, stc).to('cuda')
        rec, cnv = rec_pool.clone(), conv_pool.clone()
        torch.cuda.synchronize()
        return inputs, rec, cnv

    inputs, rec, cnv = forward(cuts)
    conv(x, cnv, inputs), gdr(q, k, v, g, beta, rec, inputs)   # warm-up: Triton compiles and autotunes
    inputs, rec, cnv = forward(cuts)
    torch.cuda.set_sync_debug_mode('error')
    try:
        got_x, got_o = conv(x, cnv, inputs), gdr(q, k, v, g, beta, rec, inputs)
    finally:
        torch.cuda.set_sync_debug_mode('default')
    inputs, want_rec, want_cnv = forward([])
    want_x, want_o = conv(x, want_cnv, inputs), gdr(q, k, v, g, beta, want_rec, inputs)
    torch.testing.assert_close(got_x, want_x)
    torch.testing.assert_close(got_o.float(), want_o.float(), atol=5e-2, rtol=5e-2)
    torch.testing.assert_close(rec[slots], want_rec[slots], atol=5e-2, rtol=5e-2)


def test_cuda_backend_routes_the_gated_delta_rule_and_hands_fla_chunk_indices(monkeypatch):
    """The cuda backend's op (fla present; kernels replaced by recorders so it runs on the CPU): bf16 prefills take
    the chunked kernel with host-built chunk indices, built once per forward; pure decodes and graph prefills take
    the token-by-token pool kernel, and so do verify forwards with their draft cuts (the op's `draft_cuts` entry);
    float32 keeps the torch kernels."""
    from lmdeploy.pytorch.backends import cuda as cuda_backend
    from lmdeploy.pytorch.backends.base import OpType
    from lmdeploy.pytorch.kernels.cuda import gated_delta_rule as cuda_gdr
    calls = []

    def recorder(kind):
        def kernel(q, k, v, g, beta, cu_seqlens, state, state_ids, is_fresh, **kwargs):
            calls.append((kind, kwargs))
            return v.new_zeros(v.shape)
        return kernel
    monkeypatch.setattr(cuda_backend, '_fla_available', lambda: True)
    monkeypatch.setattr(cuda_gdr, 'chunk_gated_delta_rule', recorder('chunk'))
    monkeypatch.setattr(cuda_gdr, 'recurrent_gated_delta_rule', recorder('fla recurrent'))
    monkeypatch.setattr(cuda_backend, 'fused_recurrent_gated_delta_rule', recorder('recurrent'))
    op = cuda_backend.BACKEND.build(OpType.GatedDeltaRule)

    def run(lens, dtype=torch.bfloat16, **overrides):
        total = sum(lens)
        q, k = torch.randn(total, HK, DK, dtype=dtype), torch.randn(total, HK, DK, dtype=dtype)
        v, beta, g = torch.randn(total, H, DV, dtype=dtype), torch.rand(total, H, dtype=dtype), -torch.rand(total, H)
        inputs = make_inputs(lens, list(range(1, len(lens) + 1)), [False] * len(lens), None)
        for name, value in overrides.items():
            setattr(inputs, name, value)
        pool = torch.zeros(4, H, DK, DV)
        op(q, k, v, g, beta, pool, inputs)
        op(q, k, v, g, beta, pool, inputs)  # a second layer of the same forward
        return calls[-2:]

    first, second = run([130, 1, 64])
    assert first[0] == second[0] == 'chunk'
    assert first[1]['chunk_indices'].tolist() == [[0, 0], [0, 1], [0, 2], [1, 0], [2, 0]]
    assert first[1]['chunk_indices'] is second[1]['chunk_indices']  # built once per forward
    assert [kind for kind, _ in run([1, 1])] == ['recurrent'] * 2
    assert [kind for kind, _ in run([5, 3], use_recurrent_kernel=True)] == ['recurrent'] * 2
    static = torch.tensor([[0, 0], [1, 0], [2, 0]])   # a CUDA-graph prefill: the runner's static, padded indices
    graph_calls = run([5, 3, 0], graph_chunk_indices=static)
    assert [kind for kind, _ in graph_calls] == ['chunk'] * 2
    assert all(kw['chunk_indices'] is static for _, kw in graph_calls)
    views = [kw['cu_seqlens_view'] for _, kw in graph_calls]  # fla's memo key: one view per forward, its layers'
    assert views[0] is views[1] and views[0].tolist() == [0, 5, 8, 8]
    assert run([5, 3, 0], graph_chunk_indices=static)[0][1]['cu_seqlens_view'] is not views[0]  # a new forward
    before = len(calls)
    run([70], dtype=torch.float32)
    assert len(calls) == before  # the torch kernels ran, not fla
    slots = torch.tensor([[3], [2]])
    for dtype, want in ((torch.bfloat16, True), (torch.float32, False)):   # a verify forward, K = 1
        q, k, v = torch.zeros(4, HK, DK, dtype=dtype), torch.zeros(4, HK, DK, dtype=dtype), torch.zeros(4, H, DV)
        inputs = make_inputs([2, 2], [1, 4], [False, False], None)
        inputs.draft_state_slots = slots
        before = len(calls)
        out = op.draft_cuts(q, k, v.to(dtype), torch.zeros(4, H), torch.zeros(4, H, dtype=dtype),
                            torch.zeros(5, H, DK, DV), inputs)
        assert (out is not None) == want and len(calls) == before + want
        if want:
            assert calls[-1][0] == 'recurrent' and calls[-1][1]['cut_slots'] is slots
