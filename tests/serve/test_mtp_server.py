"""The OpenAI server with MTP speculative decoding: a greedy chat reply equals the plain server's (the `openai` client
as the user), and `/metrics` carries the acceptance counters, which match the engine's statistics."""
from __future__ import annotations

import shutil

import httpx
import pytest
from live_server import live_server
from mtp_reference import add_random_mtp_weights
from prometheus_client.parser import text_string_to_metric_families

from lmdeploy import SpeculativeConfig
from lmdeploy.messages import PytorchEngineConfig
from lmdeploy.serve.async_engine import AsyncEngine
from lmdeploy.serve.openai.api_server import create_app

pytest.importorskip('transformers')
MODEL = 'tiny-qwen3_5'
CHAT = [{'role': 'user', 'content': 'Tell me something about the sea.'}]


def _config(**overrides) -> PytorchEngineConfig:
    return PytorchEngineConfig(device_type='cpu', block_size=16, kernel_block_size=8, num_gpu_blocks=64,
                               max_batch_size=4, **overrides)


def _metrics(url: str) -> dict[str, float]:
    text = httpx.get(f'{url}/metrics').text
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}


def _reply(path: str, config: PytorchEngineConfig) -> tuple[str, dict, dict]:
    engine = AsyncEngine(path, config, model_name=MODEL)
    try:
        with live_server(create_app(engine, None, MODEL)) as server:
            out = server.client().chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, temperature=0,
                                                          extra_body={'ignore_eos': True})
            return out.choices[0].message.content, _metrics(server.url), engine.engine.stats
    finally:
        engine.close()


def test_speculative_server_replies_like_plain_and_reports_acceptance(tiny_model_factory, tmp_path):
    path = add_random_mtp_weights(str(shutil.copytree(tiny_model_factory('qwen3_5'), tmp_path / 'mtp',
                                                      dirs_exist_ok=True)), seed=1)
    plain, plain_metrics, _ = _reply(path, _config())
    spec, metrics, stats = _reply(path, _config(speculative_config=SpeculativeConfig('mtp', 2)))
    assert spec == plain
    assert 'lmdeploy:spec_decode_num_draft_tokens_total' not in plain_metrics
    assert metrics['lmdeploy:spec_decode_num_draft_tokens_total'] == stats['spec_draft_tokens'] > 0
    assert metrics['lmdeploy:spec_decode_num_accepted_tokens_total'] == stats['spec_accepted_tokens']
    assert metrics['lmdeploy:spec_decode_num_drafts_total'] == stats['spec_verify_rows']
    assert metrics['lmdeploy:spec_decode_mean_accepted_length'] == pytest.approx(stats['spec_mean_accepted_length'])
    assert 0 <= metrics['lmdeploy:spec_decode_acceptance_rate'] <= 1
