"""The shape-only draft cuts of a verify forward (`ModelInputs.draft_state_slots`, `nn/draft_cuts.py`) against the
in-prefill cuts (`state_cuts`, tested against separate prefix forwards in `test_prefill_cuts.py`) at the same
offsets 1 .. K, through the conv and the gated delta rule.

- CPU (default backend): outputs, final states and every cut row equal; no other pool row changes.
- GPU (cuda backend, bf16 on fla): the draft-cut layers replayed from a CUDA graph on new states and slots equal
  eager, and the eager forward queues its work without a device synchronisation.
"""
from __future__ import annotations

import pytest
import torch

from lmdeploy.pytorch.backends.selector import use_backend
from lmdeploy.pytorch.model_inputs import ModelInputs, StateCuts
from lmdeploy.pytorch.nn.gated_delta import CausalConv1d, GatedDeltaRule

HK, H, DK, DV, C, KERNEL = 2, 4, 8, 6, 12, 4
SLOTS = 16


def _inputs(batch: int, k: int, state_ids: list[int], fresh: list[bool], cut_slots: list[list[int]],
            shape_only: bool) -> ModelInputs:
    rows = k + 1
    lens = [rows] * batch
    total = batch * rows
    cuts = None if shape_only else StateCuts(
        rows=[b for b in range(batch) for _ in range(k)], offsets=[o for _ in range(batch) for o in range(1, k + 1)],
        slots=[s for row in cut_slots for s in row], q_lens=lens, state_ids=state_ids, is_fresh=fresh)
    return ModelInputs(
        input_ids=torch.zeros(total, dtype=torch.int64), position_ids=torch.zeros(total, dtype=torch.int64),
        q_lens=torch.tensor(lens), kv_lens=torch.tensor(lens), cu_seqlens_q=torch.arange(batch + 1) * rows,
        block_tables=torch.zeros(batch, 1, dtype=torch.int64), slot_mapping=torch.zeros(total, dtype=torch.int64),
        logits_indices=torch.zeros(0, dtype=torch.int64), state_ids=torch.tensor(state_ids),
        is_fresh=torch.tensor(fresh), q_lens_list=lens, kv_lens_list=lens, max_seqlen_q=rows, max_seqlen_k=rows,
        state_cuts=cuts, draft_state_slots=torch.tensor(cut_slots) if shape_only else None)


def _layers(backend: str):
    with use_backend(backend):
        gdr, conv = GatedDeltaRule(), CausalConv1d(C, KERNEL)
    conv.weight.data.normal_()
    return gdr, conv


def _tensors(total: int, device='cpu', dtype=torch.float32):
    q, k = torch.randn(total, HK, DK), torch.randn(total, HK, DK)
    v, beta, g, x = torch.randn(total, H, DV), torch.rand(total, H), -torch.rand(total, H), torch.randn(total, C)
    return [t.to(device, dtype if t is not g else torch.float32) for t in (q, k, v, g, beta, x)]


# (K, state rows, fresh flags): K = 1 (one cut), K = 3 and K = 5 (cuts farther than the conv history width from
# the row start, so some histories come from the inputs alone), fresh and continuing rows mixed.
CASES = [(1, [1], [False]), (3, [1, 2, 3], [False, True, False]), (5, [2, 1], [True, False])]


@pytest.mark.parametrize('k, state_ids, fresh', CASES, ids=['K1', 'K3', 'K5'])
def test_draft_cuts_equal_the_same_state_cuts(k, state_ids, fresh):
    torch.manual_seed(0)
    batch = len(state_ids)
    cut_slots = [[4 + b * k + j for j in range(k)] for b in range(batch)]
    gdr, conv = _layers('default')
    q, kk, v, g, beta, x = _tensors(batch * (k + 1))
    rec_pool, conv_pool = torch.randn(SLOTS, H, DK, DV), torch.randn(SLOTS, C, KERNEL - 1)
    results = []
    for shape_only in (False, True):
        rec, cnv = rec_pool.clone(), conv_pool.clone()
        inputs = _inputs(batch, k, state_ids, fresh, cut_slots, shape_only)
        out_x = conv(x, cnv, inputs)
        out_o = gdr(q, kk, v, g, beta, rec, inputs)
        results.append((out_x, out_o, rec, cnv))
    (want_x, want_o, want_rec, want_conv), (got_x, got_o, got_rec, got_conv) = results
    torch.testing.assert_close(got_x, want_x, atol=0, rtol=0)
    torch.testing.assert_close(got_o, want_o, atol=0, rtol=0)
    torch.testing.assert_close(got_rec, want_rec, atol=0, rtol=0)  # final, cut and untouched rows alike
    torch.testing.assert_close(got_conv, want_conv, atol=0, rtol=0)
    touched = set(state_ids) | {s for row in cut_slots for s in row}
    for slot in set(range(SLOTS)) - touched:
        assert torch.equal(got_rec[slot], rec_pool[slot]) and torch.equal(got_conv[slot], conv_pool[slot])


@pytest.mark.gpu
def test_cuda_draft_cut_layers_replay_from_a_graph_and_never_synchronise():
    pytest.importorskip('fla')
    torch.manual_seed(0)
    k, batch = 3, 4
    gdr, conv = _layers('cuda')
    conv.cuda()
    conv.weight.data = conv.weight.data.bfloat16()
    static = [t for t in _tensors(batch * (k + 1), 'cuda', torch.bfloat16)]
    rec = torch.zeros(SLOTS, H, DK, DV, device='cuda')
    cnv = torch.zeros(SLOTS, C, KERNEL - 1, device='cuda', dtype=torch.bfloat16)
    inputs = _inputs(batch, k, [1, 2, 3, 0], [False, True, False, True], [[0] * k] * batch, True).to('cuda')

    def forward():
        q, kk, v, g, beta, x = static
        return conv(x, cnv, inputs), gdr(q, kk, v, g, beta, rec, inputs)
    forward()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_x, out_o = forward()
    # new inputs, states and cut slots, written in place; the replay must equal an eager run on them
    for t, new in zip(static, _tensors(batch * (k + 1), 'cuda', torch.bfloat16)):
        t.copy_(new)
    rec_pool = torch.randn(SLOTS, H, DK, DV, device='cuda') * 0.1
    conv_pool = torch.randn(SLOTS, C, KERNEL - 1, device='cuda', dtype=torch.bfloat16)
    inputs.draft_state_slots.copy_(torch.tensor([[4, 5, 6], [7, 8, 9], [10, 11, 12], [0, 0, 0]]))
    rec.copy_(rec_pool)
    cnv.copy_(conv_pool)
    graph.replay()
    got = (out_x.clone(), out_o.clone(), rec.clone(), cnv.clone())
    rec.copy_(rec_pool)
    cnv.copy_(conv_pool)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode('error')
    try:
        want_x, want_o = forward()
    finally:
        torch.cuda.set_sync_debug_mode('default')
    real = [1, 2, 3, *range(4, 13)]  # row 0 is the padding's dummy
    torch.testing.assert_close(got[0][:3 * (k + 1)], want_x[:3 * (k + 1)])
    torch.testing.assert_close(got[1][:3 * (k + 1)], want_o[:3 * (k + 1)])
    torch.testing.assert_close(got[2][real], rec[real])
    torch.testing.assert_close(got[3][real], cnv[real])
