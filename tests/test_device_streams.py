"""Forward-stream discipline: payload registry on any device, record_stream regression on CUDA."""
from __future__ import annotations

import pytest
import torch

from lmdeploy.pytorch.engine.cache_inputs import CacheCheckpointInputs
from lmdeploy.pytorch.engine.device_streams import DeviceStreams, payload_tensors, register_payload


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
