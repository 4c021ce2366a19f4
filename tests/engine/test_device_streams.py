"""Forward-stream discipline: payload registry on any device, record_stream regression on CUDA."""
from __future__ import annotations

import pytest
import torch

from lmdeploy.pytorch.engine.cache_inputs import CacheCheckpointInputs
from lmdeploy.pytorch.engine.device_streams import DeviceStreams, payload_tensors, register_payload
from lmdeploy.pytorch.model_inputs import upload_index_tensors


class _UnknownPayload:

    def to(self, device, non_blocking=False):
        return self


class _NoTensorPayload:

    def to(self, device, non_blocking=False):
        return self


def test_unknown_payload_type_fails_loudly():
    with pytest.raises(TypeError, match='unknown payload type _UnknownPayload'):
        DeviceStreams(torch.device('cpu')).to_device(_UnknownPayload())


def test_payload_without_tensors_must_be_declared():
    register_payload(_NoTensorPayload, None)
    assert payload_tensors(_NoTensorPayload()) == []


def test_cache_plans_are_payload_tensors():
    plans = CacheCheckpointInputs.build([(1, 2)], [(3, 4)], [], [(4, 5)], resolve=lambda ids: ids)
    assert len(payload_tensors(plans)) == 3


@pytest.mark.gpu
def test_payload_memory_is_not_reused_while_the_forward_reads_it():
    """A payload copied on the side stream and dropped by Python must survive until the forward that reads it
    has run: the next copy may not be handed its memory (record_stream on the forward stream)."""
    device = torch.device('cuda')
    streams = DeviceStreams(device)
    n = 1 << 20
    plans = CacheCheckpointInputs(kv_restore_plan=torch.arange(2 * n, dtype=torch.int64).view(2, n))
    (moved,) = streams.to_device(plans)
    expected = moved.kv_restore_plan.sum().item()
    with streams.forward():
        torch.cuda._sleep(200_000_000)  # keep the forward stream busy so the read below runs late
        out = moved.kv_restore_plan.sum()
    del moved, plans
    with torch.cuda.stream(streams.copy_stream):
        clobber = torch.full((2, n), -1, dtype=torch.int64, device=device)  # would reuse the freed block
        clobber.fill_(-7)
    torch.cuda.synchronize()
    assert out.item() == expected


@pytest.mark.gpu
def test_collected_logits_wait_for_the_forward_stream(tiny_model_factory):
    """Logits collected for tests and scoring are copied to the host after the forward stream has produced them:
    with the forward stream held back (a sleep before the lm head), they still equal an undisturbed run's. (They
    were once copied on the default stream, which does not wait for the forward stream, so replayed CUDA graphs,
    queued in one go, handed back stale logits.)"""
    from lmdeploy.messages import PytorchEngineConfig
    from lmdeploy.pytorch.engine.engine import Engine
    from lmdeploy.pytorch.messages import SamplingParams

    def run(engine):
        outs = {}
        ids = [engine.add_request(p, SamplingParams(max_new_tokens=6), collect_logits=True,
                                  callback=lambda o: outs.setdefault(o.seq_id, []).extend(o.new_token_ids))
               for p in ([5, 6, 7], list(range(40, 57)))]
        engine.run_until_idle()
        return [(outs[i], engine.pop_collected_logits(i)) for i in ids]

    path = tiny_model_factory('qwen3')
    common = dict(device_type='cuda', dtype='float32', num_gpu_blocks=64, max_batch_size=4)
    ref = run(Engine(path, PytorchEngineConfig(**common)))
    slow = Engine(path, PytorchEngineConfig(**common))
    compute_logits = slow.model.compute_logits

    def late_logits(hidden):
        torch.cuda._sleep(50_000_000)  # on the forward stream: the logits come late
        return compute_logits(hidden)
    slow.model.compute_logits = late_logits
    got = run(slow)
    for (tokens, logits), (ref_tokens, ref_logits) in zip(got, ref):
        assert tokens == ref_tokens
        assert torch.allclose(logits, ref_logits, atol=1e-4), (logits - ref_logits).abs().max()


def _index_host_tensors() -> dict[str, torch.Tensor]:
    return dict(a=torch.tensor([[1, 2], [3, -4]]), b=torch.tensor([True, False, True]),
                c=torch.zeros(0, dtype=torch.int64), d=torch.tensor(2**40))


@pytest.mark.parametrize('device', ['cpu', pytest.param('cuda', marks=pytest.mark.gpu)])
def test_upload_index_tensors_keep_values_and_dtypes(device):
    host = _index_host_tensors()
    got = upload_index_tensors(host, torch.device(device))
    assert got.keys() == host.keys()
    for name, t in host.items():
        assert got[name].device.type == device and got[name].dtype == t.dtype and got[name].shape == t.shape
        assert torch.equal(got[name].cpu(), t), name
    empty = upload_index_tensors(dict(x=torch.zeros(0, dtype=torch.int64)), torch.device(device))
    assert empty['x'].shape == (0,) and empty['x'].device.type == device


@pytest.mark.gpu
def test_upload_index_tensors_never_synchronise():
    """The upload is one pinned non-blocking copy: torch's sync debug mode raises on any synchronising op."""
    host = _index_host_tensors()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode('error')
    try:
        got = upload_index_tensors(host, torch.device('cuda'))
    finally:
        torch.cuda.set_sync_debug_mode('default')
    assert torch.equal(got['a'].cpu(), host['a'])
