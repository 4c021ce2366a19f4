"""`packed_upload.upload_packed`: the host tensors of several payloads in one packed copy come back with their
values, dtypes and shapes exactly, every other field untouched (against each payload's own `.to`)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from lmdeploy.pytorch.engine.cache_inputs import CacheCheckpointInputs
from lmdeploy.pytorch.engine.packed_upload import packable, upload_packed
from lmdeploy.pytorch.model_inputs import ModelInputs, SamplingInputs


def _inputs(seed: int, batch: int) -> ModelInputs:
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, 9, (batch,), generator=gen)
    tokens = int(lens.sum())
    return ModelInputs(
        input_ids=torch.randint(0, 2**40, (tokens,), generator=gen), position_ids=torch.arange(tokens) * 3,
        q_lens=lens, kv_lens=lens + 5, cu_seqlens_q=torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)]),
        block_tables=torch.randint(0, 99, (batch, 3), generator=gen), slot_mapping=-torch.arange(tokens),
        logits_indices=torch.zeros(0, dtype=torch.int64), state_ids=torch.arange(batch),
        is_fresh=torch.rand(batch, generator=gen) > 0.5, q_lens_list=lens.tolist(), kv_lens_list=(lens + 5).tolist(),
        max_seqlen_q=int(lens.max()), max_seqlen_k=int(lens.max()) + 5,
        draft_state_slots=torch.randint(0, 7, (batch, 3), generator=gen),
        mm_embeds=torch.randn(batch, 5, generator=gen).to(torch.bfloat16))  # a dtype numpy has not


def _same(got, want, device) -> None:
    for f in dataclasses.fields(want):
        a, b = getattr(got, f.name), getattr(want, f.name)
        if isinstance(b, torch.Tensor):
            assert a.device.type == device.type and a.dtype == b.dtype and a.shape == b.shape, f.name
            assert torch.equal(a.cpu(), b.cpu()), f.name
        elif f.init:
            assert a == b, f.name


def _sampling(penalty: bool) -> SamplingInputs:
    return SamplingInputs(temperature=torch.tensor([0.0, 0.7]), top_k=torch.tensor([0, 20]),
                          top_p=torch.tensor([1.0, 0.9]), repetition_penalty=torch.tensor([1.0, 1.1]),
                          penalty_ids=[None, torch.tensor([3, 4])] if penalty else [None, None],
                          banned_ids=[None, None], generators=[None, None], all_greedy=False)


def _payloads():
    plan = CacheCheckpointInputs(state_restore_plan=torch.tensor([[1, 2, 3], [4, 5, 6]]))
    return [_inputs(0, 3), None, plan, _inputs(1, 1), CacheCheckpointInputs(), _sampling(penalty=False)]


def test_only_payloads_whose_tensors_are_all_fields_are_packable():
    assert all(packable(p) for p in _payloads() if p is not None)
    assert not packable(_sampling(penalty=True))  # its penalty ids sit in a list


def _check(device: torch.device, pack: bool | None) -> None:
    payloads = _payloads()
    got = upload_packed(payloads, device, pack=pack)
    assert got[1] is None
    for g, p in zip(got, payloads):
        if p is not None:
            _same(g, p.to(device), device)


def test_packed_upload_returns_every_tensor_exactly_and_keeps_other_fields():
    _check(torch.device('cpu'), pack=True)   # through the packed byte buffer (unaligned sizes: bool, 3-row plans)
    _check(torch.device('cpu'), pack=None)   # off CUDA by default: each payload's own .to


@pytest.mark.gpu
def test_packed_upload_to_cuda_is_exact():
    _check(torch.device('cuda'), pack=None)
    torch.cuda.synchronize()


def test_plain_forwards_pack_unless_switched_off(monkeypatch):
    """Plain forwards' packed upload is on by default; `LMDEPLOY_PACKED_UPLOAD=0` turns it off."""
    from lmdeploy.pytorch.engine.packed_upload import packed_uploads_enabled
    monkeypatch.delenv('LMDEPLOY_PACKED_UPLOAD', raising=False)
    assert packed_uploads_enabled()
    for value, on in (('0', False), ('1', True)):
        monkeypatch.setenv('LMDEPLOY_PACKED_UPLOAD', value)
        assert packed_uploads_enabled() is on
