"""Projections of one input stacked into one GEMM after loading (`nn.linear.fuse_rows`): Qwen3-Next's gated-DeltaNet
`in_proj_qkvz` + `in_proj_ba` and its MoE block's shared-expert `gate_up_proj` + router + shared-expert gate.

The fused model must hold the same parameters in the same memory (each module's weight a view of the stacked one)
and compute what the unfused modules compute; a module that gains a LoRA adapter after loading runs alone again.
The model-level parity with transformers and peft runs through the same loader (tests/models/test_*_reference.py,
test_lora_models.py).
"""
from __future__ import annotations

import pytest
import torch

from lmdeploy.pytorch.models.loader import build_model
from lmdeploy.pytorch.models.qwen3_next import GatedDeltaNet
from lmdeploy.pytorch.nn.linear import FUSED_ROW_ALIGN, fuse_rows, unstack
from lmdeploy.pytorch.nn.moe import SparseMoeBlock


def _load(path: str, monkeypatch, fuse: bool):
    monkeypatch.setenv('LMDEPLOY_FUSE_PROJECTIONS', '1' if fuse else '0')
    model, _ = build_model(path, torch.device('cpu'), 'float32', 'cpu')
    return model


def _blocks(model) -> tuple[list[GatedDeltaNet], list[SparseMoeBlock]]:
    mods = list(model.modules())
    return [m for m in mods if isinstance(m, GatedDeltaNet)], [m for m in mods if isinstance(m, SparseMoeBlock)]


@pytest.fixture(scope='module')
def next_path(tiny_model_factory):
    return tiny_model_factory('qwen3_next')


def test_fused_model_keeps_its_parameters_in_the_same_memory(next_path, monkeypatch):
    fused, plain = _load(next_path, monkeypatch, True), _load(next_path, monkeypatch, False)
    mixers, moes = _blocks(fused)
    assert mixers and moes and all(m._fused_in is not None for m in mixers + moes)
    assert all(m._fused_in is None for m in sum(_blocks(plain), []))
    a, b = fused.state_dict(), plain.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert sum(p.numel() for p in fused.parameters()) == sum(p.numel() for p in plain.parameters())
    for mixer in mixers:  # the modules' weights are the stacked tensor's rows, back to back
        base = mixer._fused_in.data_ptr()
        rows = mixer.in_proj_qkvz.weight.shape[0] * mixer.in_proj_qkvz.weight.stride(0)
        assert mixer.in_proj_qkvz.weight.data_ptr() == base
        assert mixer.in_proj_ba.weight.data_ptr() == base + rows * mixer._fused_in.element_size()
    for moe in moes:
        assert moe.shared_expert.gate_up_proj.weight.data_ptr() == moe._fused_in.data_ptr()
    for stacked in (m._fused_in for m in mixers + moes):  # GEMM output rows stay aligned
        assert stacked.shape[0] % FUSED_ROW_ALIGN == 0


@torch.inference_mode()
def test_fused_projections_compute_what_the_modules_compute(next_path, monkeypatch):
    model = _load(next_path, monkeypatch, True)
    mixers, moes = _blocks(model)
    x = torch.randn(7, mixers[0].in_proj_qkvz.weight.shape[1], generator=torch.Generator().manual_seed(0))
    for mixer in mixers:
        fused = mixer._in_proj(x)
        qkvz, ba = mixer.in_proj_qkvz, mixer.in_proj_ba
        expected = (*qkvz(x).split(qkvz.shard_sizes, -1), *ba(x).split(ba.shard_sizes, -1))
        assert len(fused) == 4 and all(torch.allclose(f, e, atol=1e-6) for f, e in zip(fused, expected))
    for moe in moes:
        out = moe(x)
        stacked, moe._fused_in = moe._fused_in, None
        expected = moe(x)
        moe._fused_in = stacked
        assert torch.allclose(out, expected, atol=1e-6)


def test_a_projection_with_a_lora_adapter_runs_alone(next_path, monkeypatch):
    model = _load(next_path, monkeypatch, True)
    mixer = _blocks(model)[0][0]
    calls = []
    mixer.in_proj_ba.lora = lambda x, out: calls.append(x.shape) or out + 1.0  # attached after loading
    x = torch.randn(3, mixer.in_proj_ba.weight.shape[1])
    with torch.inference_mode():
        *_, b, a = mixer._in_proj(x)
        expected = torch.nn.functional.linear(x, mixer.in_proj_ba.weight) + 1.0
    assert calls == [x.shape] and torch.allclose(torch.cat([b, a], -1), expected, atol=1e-6)


def test_fuse_rows_refuses_what_it_cannot_stack():
    from lmdeploy.pytorch.nn.linear import Linear
    a, b = Linear(8, 4), Linear(8, 3, bias=True)
    for m in (a, b):
        torch.nn.init.normal_(m.weight)
    assert fuse_rows([a, b]) is None  # a bias
    c = Linear(6, 2)
    assert fuse_rows([a, c]) is None  # another input width
    d = Linear(8, 5)
    torch.nn.init.normal_(d.weight)  # not left uninitialised: stray NaNs made torch.equal fail at random
    before = (a.weight.clone(), d.weight.clone())
    stacked = fuse_rows([a, d])  # 9 rows, padded with zeros to 16 (aligned output rows)
    assert stacked.shape == (16, 8) and torch.equal(stacked[:9], torch.cat(before)) and not stacked[9:].any()
    assert torch.equal(a.weight, before[0]) and torch.equal(d.weight, before[1])
    x = torch.randn(3, 8)
    outs = unstack(torch.nn.functional.linear(x, stacked), [4, 5])
    assert [o.shape[-1] for o in outs] == [4, 5]
    assert torch.allclose(outs[0], torch.nn.functional.linear(x, before[0]), atol=1e-6)
    assert torch.allclose(outs[1], torch.nn.functional.linear(x, before[1]), atol=1e-6)
