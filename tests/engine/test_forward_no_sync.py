"""An eager model forward on the cuda backend queues its work without waiting for the device (GPU only).

Every model family runs prefills (chunked, with cached history) and decodes through the engine in eager mode; the
model's forward runs under torch's sync debug mode 'error', which raises on any synchronising op (a `.item()`, a
`.tolist()`, a pageable upload, `nonzero`, ...). Only the forward is checked: sampling reads tokens back by design.
The outputs must equal those of the same engine run without the debug mode (the check changes nothing).
"""
from __future__ import annotations

import pytest
import torch

from lmdeploy.messages import PytorchEngineConfig
from lmdeploy.pytorch.engine.engine import Engine
from lmdeploy.pytorch.messages import SamplingParams

pytestmark = pytest.mark.gpu


def _run(engine: Engine, prompts: list[list[int]]) -> list[list[int]]:
    outs: dict[int, list[int]] = {}
    ids = [engine.add_request(p, SamplingParams(max_new_tokens=4),
                              callback=lambda o: outs.setdefault(o.seq_id, []).extend(o.new_token_ids))
           for p in prompts]
    while engine.has_work:
        engine.step()
    return [outs[i] for i in ids]


def _forbid_sync_in_forward(engine: Engine) -> list[int]:
    """Wrap the model's forward in sync debug mode 'error'; returns a list that counts the checked forwards."""
    model = engine.agent.model
    forward = model.forward
    calls: list[int] = []

    def checked(*args, **kwargs):
        torch.cuda.set_sync_debug_mode('error')
        try:
            return forward(*args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode('default')
            calls.append(1)
    model.forward = checked
    return calls


@pytest.mark.parametrize('arch', ['qwen3', 'qwen3_5', 'qwen3_next'])
@pytest.mark.parametrize('dtype', ['bfloat16', 'float32'])
def test_eager_forward_never_synchronises(tiny_model_factory, arch, dtype):
    if arch != 'qwen3' and dtype == 'bfloat16':
        pytest.importorskip('fla')
    path = tiny_model_factory(arch)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 1000, (n,), generator=g).tolist() for n in (1, 9, 70, 130)]
    config = PytorchEngineConfig(device_type='cuda', dtype=dtype, eager_mode=True, block_size=16,
                                 kernel_block_size=8, num_gpu_blocks=256, max_prefill_token_num=64)
    engine = Engine(path, config)
    want = _run(engine, prompts)  # warm-up too: Triton compiles (and fla autotunes) outside the checked run
    calls = _forbid_sync_in_forward(engine)
    got = _run(engine, prompts)
    assert len(calls) >= 6, f'only {len(calls)} forwards were checked'
    assert got == want
