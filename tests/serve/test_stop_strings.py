"""Stop strings end the generation itself, not just the text: a scripted model that never stops on its own is cut
where a stop string completes across token boundaries, `completion_tokens` counts up to that token, and nothing
of the stop string (or of text that might begin it) is ever streamed."""
from __future__ import annotations

import time

import pytest
from chat_templates import QWEN3, QWEN3_PROMPT_ENDS
from live_server import live_server
from scripted_model import save_scripted_model

from lmdeploy import pipeline
from lmdeploy.messages import GenerationConfig, PytorchEngineConfig
from lmdeploy.serve.async_engine import AsyncEngine
from lmdeploy.serve.openai.api_server import create_app

# loops forever; "STOP" spans pieces 2 and 3, "STONE" begins like it but is not it
SCRIPT = ['Hello wor', 'ld! A STONE, ', 'then ST', 'OP here', ' and on']
ASK = [{'role': 'user', 'content': 'Go.'}]


def engine_config() -> PytorchEngineConfig:
    return PytorchEngineConfig(device_type='cpu', block_size=16, max_batch_size=8, num_gpu_blocks=256)


@pytest.fixture(scope='module')
def model_path(tmp_path_factory) -> str:
    return save_scripted_model(str(tmp_path_factory.mktemp('looper')), SCRIPT, QWEN3, QWEN3_PROMPT_ENDS, loop=True)


@pytest.fixture(scope='module')
def live(model_path):
    engine = AsyncEngine(model_path, engine_config(), model_name='looper')
    with live_server(create_app(engine)) as server:
        yield server, engine
    engine.close()


def _wait_idle(engine: AsyncEngine) -> None:
    deadline = time.monotonic() + 10
    while engine.engine.scheduler.has_unfinished:
        assert time.monotonic() < deadline, 'the engine kept generating after the stop string'
        time.sleep(0.01)
    with engine.engine._step_lock:  # between steps of the loop thread
        engine.engine.check_integrity()


def test_without_a_stop_string_the_model_runs_to_max_tokens(live):
    server, engine = live
    r = server.client().chat.completions.create(model='looper', messages=ASK, temperature=0, max_tokens=40)
    assert r.usage.completion_tokens == 40 and r.choices[0].finish_reason == 'length'


def test_stop_string_across_tokens_stops_generation(live):
    server, engine = live
    r = server.client().chat.completions.create(model='looper', messages=ASK, temperature=0, max_tokens=500,
                                                stop=['STOP'])
    assert r.choices[0].message.content == 'Hello world! A STONE, then '
    assert r.choices[0].finish_reason == 'stop'
    assert r.usage.completion_tokens == 4  # the token "OP here" completed it
    _wait_idle(engine)


def test_streamed_stop_string_never_leaks(live):
    server, engine = live
    stream = server.client().chat.completions.create(model='looper', messages=ASK, temperature=0, max_tokens=500,
                                                     stop=['STOP', 'never'], stream=True,
                                                     stream_options={'include_usage': True})
    chunks = list(stream)
    deltas = [c.choices[0].delta.content or '' for c in chunks if c.choices]
    assert ''.join(deltas) == 'Hello world! A STONE, then '
    assert not any('ST' in d and 'STONE' not in d for d in deltas)  # "then ST" was held back, then dropped
    assert chunks[-1].usage.completion_tokens == 4
    _wait_idle(engine)


def test_completions_stop_string(live):
    server, engine = live
    prompt = engine.tokenizer.apply_chat_template(ASK)
    r = server.client().completions.create(model='looper', prompt=prompt, temperature=0, max_tokens=500,
                                           stop='ld! A')
    assert (r.choices[0].text, r.usage.completion_tokens, r.choices[0].finish_reason) == ('Hello wor', 2, 'stop')
    _wait_idle(engine)


def test_pipeline_stop_string_ends_the_request(model_path):
    with pipeline(model_path, engine_config()) as pipe:
        gen = GenerationConfig(max_new_tokens=500, stop_words=['STOP'])
        responses = pipe([ASK, ASK], gen)
        assert [(r.text, r.generate_token_len, r.finish_reason) for r in responses] == [
            ('Hello world! A STONE, then ', 4, 'stop')] * 2
        streamed = list(pipe.stream_infer([ASK], gen))
        assert ''.join(r.text for r in streamed) == 'Hello world! A STONE, then '
        deadline = time.monotonic() + 10
        while pipe.engine.scheduler.has_unfinished:
            assert time.monotonic() < deadline
            time.sleep(0.01)
