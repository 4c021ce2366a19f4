"""User-level behaviour of `lmdeploy.pipeline` and `lmdeploy demo` on a tiny random-weight Qwen3 checkpoint.

Most tests share one module-wide pipeline (its engine loop runs on a background thread); every request has ended when
`pipe(...)` returns, so the KV pool must be entirely free then.
"""
from __future__ import annotations

import json
import re
import shutil
import threading

import pytest
import torch
import transformers
from numeric import assert_close

from lmdeploy import GenerationConfig, PytorchEngineConfig, Response, pipeline
from lmdeploy.cli.entrypoint import main as cli_main

SESSION_LEN = 128
PROMPT_IDS = [5, 17, 300, 42, 9, 811, 64]
GREEDY = GenerationConfig(max_new_tokens=8, ignore_eos=True)


def _engine_config(**overrides) -> PytorchEngineConfig:
    config = dict(device_type='cpu', block_size=16, kernel_block_size=8, num_gpu_blocks=32, session_len=SESSION_LEN)
    return PytorchEngineConfig(**{**config, **overrides})


@pytest.fixture(scope='module')
def model_path(tiny_model_factory) -> str:
    return tiny_model_factory('qwen3')


@pytest.fixture(scope='module')
def pipe(model_path):
    with pipeline(model_path, _engine_config()) as pipe:
        yield pipe


@pytest.fixture(scope='module')
def hf_model(model_path):
    return transformers.Qwen3ForCausalLM.from_pretrained(model_path).eval()


@torch.no_grad()
def _hf_logits(model, token_ids: list[int]) -> torch.Tensor:
    position_ids = torch.arange(len(token_ids))[None]
    return model(input_ids=torch.tensor([token_ids]), position_ids=position_ids).logits[0].float()


def _assert_pool_free(pipe) -> None:
    """Every request has ended: no KV block may still be owned."""
    block_manager = pipe.engine.scheduler.block_manager
    assert block_manager.num_free == block_manager.num_blocks, 'KV blocks leaked'
    pipe.engine.check_integrity()


def _chat_ids(pipe, text: str) -> list[int]:
    prompt = pipe.tokenizer.apply_chat_template([{'role': 'user', 'content': text}])
    return pipe.tokenizer.encode(prompt, add_special_tokens=False)


# ---- prompts ---------------------------------------------------------------------------------------------------
def test_token_id_prompt_generates_the_transformers_greedy_continuation(pipe, hf_model):
    response = pipe(PROMPT_IDS, GREEDY)
    assert isinstance(response, Response)
    assert response.input_token_len == len(PROMPT_IDS)
    assert response.generate_token_len == 8 and response.finish_reason == 'length'
    ids = list(PROMPT_IDS)
    for _ in range(8):
        ids.append(int(_hf_logits(hf_model, ids)[-1].argmax()))
    assert response.token_ids == ids[len(PROMPT_IDS):]
    assert response.text == pipe.tokenizer.decode(response.token_ids)
    _assert_pool_free(pipe)


def test_str_prompt_is_wrapped_in_the_chat_template(pipe):
    chat_ids = _chat_ids(pipe, 'Hello there')
    response = pipe('Hello there', GREEDY)
    assert response.input_token_len == len(chat_ids)
    assert response.token_ids == pipe(chat_ids, GREEDY).token_ids


def test_messages_prompt_equals_the_same_text_as_str(pipe):
    messages = [{'role': 'user', 'content': 'Hello there'}]
    from_messages, from_str = pipe(messages, GREEDY), pipe('Hello there', GREEDY)
    assert from_messages.input_token_len == from_str.input_token_len
    assert from_messages.token_ids == from_str.token_ids


def test_do_preprocess_false_feeds_the_raw_text(pipe):
    raw_ids = pipe.tokenizer.encode('Hello there')
    response = pipe('Hello there', GREEDY, do_preprocess=False)
    assert response.input_token_len == len(raw_ids) < len(_chat_ids(pipe, 'Hello there'))
    assert response.token_ids == pipe(raw_ids, GREEDY).token_ids


def test_list_of_prompts_returns_responses_in_order(pipe):
    prompts = ['The quick brown fox', PROMPT_IDS, [{'role': 'user', 'content': 'Tell me about the sea.'}], 'a']
    alone = [pipe(p, GREEDY) for p in prompts]
    batch = pipe(prompts, GREEDY)
    assert isinstance(batch, list) and [r.index for r in batch] == [0, 1, 2, 3]
    for one, batched in zip(alone, batch):
        assert (batched.token_ids, batched.text, batched.input_token_len) == \
            (one.token_ids, one.text, one.input_token_len)
    _assert_pool_free(pipe)


def test_per_prompt_generation_configs_apply_to_their_prompt(pipe):
    configs = [GenerationConfig(max_new_tokens=n, ignore_eos=True) for n in (3, 1, 5)]
    responses = pipe(['x', 'y', 'z'], configs)
    assert [r.generate_token_len for r in responses] == [3, 1, 5]
    with pytest.raises(ValueError, match='2 generation configs for 3 prompts'):
        pipe(['x', 'y', 'z'], configs[:2])


def test_stream_infer_pieces_concatenate_to_the_batch_result(pipe):
    expected = pipe('Hello there', GREEDY)
    pieces = list(pipe.stream_infer('Hello there', GREEDY))
    assert len(pieces) == 8
    assert [p.generate_token_len for p in pieces] == list(range(1, 9))
    assert [p.finish_reason for p in pieces] == [None] * 7 + ['length']
    assert sum((p.token_ids for p in pieces), []) == expected.token_ids
    assert ''.join(p.text for p in pieces) == expected.text


def test_stream_infer_of_a_list_tags_pieces_with_the_prompt_index(pipe):
    prompts = ['Hello there', PROMPT_IDS, 'What time is it?']
    configs = [GenerationConfig(max_new_tokens=n, ignore_eos=True) for n in (4, 6, 2)]
    expected = pipe(prompts, configs)
    tokens: dict[int, list[int]] = {0: [], 1: [], 2: []}
    texts = {0: '', 1: '', 2: ''}
    for piece in pipe.stream_infer(prompts, configs):
        tokens[piece.index] += piece.token_ids
        texts[piece.index] += piece.text
    for response in expected:
        assert tokens[response.index] == response.token_ids
        assert texts[response.index] == response.text
    _assert_pool_free(pipe)


# ---- generation config -----------------------------------------------------------------------------------------
def test_max_new_tokens_ends_with_finish_reason_length(pipe):
    for n in (1, 5):
        response = pipe(PROMPT_IDS, GenerationConfig(max_new_tokens=n, ignore_eos=True))
        assert response.generate_token_len == len(response.token_ids) == n
        assert response.finish_reason == 'length'
    response = pipe(PROMPT_IDS, GenerationConfig(max_new_tokens=0))
    assert response.token_ids == [] and response.finish_reason == 'length'


def test_stop_token_ids_stop_before_the_stop_token(pipe):
    free_run = pipe(PROMPT_IDS, GREEDY).token_ids
    stop_id = free_run[3]
    first = free_run.index(stop_id)
    response = pipe(PROMPT_IDS, GenerationConfig(max_new_tokens=8, stop_token_ids=[stop_id]))
    assert response.finish_reason == 'stop'
    assert response.token_ids == free_run[:first]  # the stop token itself is not returned
    _assert_pool_free(pipe)


def test_min_new_tokens_suppresses_early_stop_tokens(pipe):
    free_run = pipe(PROMPT_IDS, GREEDY).token_ids
    stop_id = free_run[0]
    stopped = pipe(PROMPT_IDS, GenerationConfig(max_new_tokens=8, stop_token_ids=[stop_id]))
    assert stopped.token_ids == [] and stopped.finish_reason == 'stop'
    held = pipe(PROMPT_IDS, GenerationConfig(max_new_tokens=8, min_new_tokens=4, stop_token_ids=[stop_id]))
    assert held.generate_token_len >= 4
    assert stop_id not in held.token_ids
    assert held.finish_reason in ('stop', 'length')


def test_eos_from_generation_config_stops_unless_ignore_eos(model_path, tmp_path):
    # make the 3rd greedy token of PROMPT_IDS the checkpoint's eos
    with pipeline(model_path, _engine_config()) as pipe:
        free_run = pipe(PROMPT_IDS, GREEDY).token_ids
    eos = free_run[2]
    first = free_run.index(eos)
    path = tmp_path / 'eos-model'
    shutil.copytree(model_path, path)
    gen_config = json.loads((path / 'generation_config.json').read_text())
    (path / 'generation_config.json').write_text(json.dumps({**gen_config, 'eos_token_id': eos}))
    with pipeline(str(path), _engine_config()) as pipe:
        stopped = pipe(PROMPT_IDS, GenerationConfig(max_new_tokens=8))
        ignored = pipe(PROMPT_IDS, GenerationConfig(max_new_tokens=8, ignore_eos=True))
    assert stopped.token_ids == free_run[:first] and stopped.finish_reason == 'stop'
    assert ignored.token_ids == free_run and ignored.finish_reason == 'length'


def test_seeded_sampling_is_reproducible_and_differs_across_seeds(pipe):
    def sample(seed: int) -> list[int]:
        config = GenerationConfig(max_new_tokens=12, do_sample=True, temperature=1.0, random_seed=seed,
                                  ignore_eos=True)
        return pipe(PROMPT_IDS, config).token_ids

    runs = {seed: sample(seed) for seed in (1, 2, 3)}
    assert sample(1) == runs[1]
    assert len({tuple(tokens) for tokens in runs.values()}) == 3, 'different seeds drew the same tokens'
    # the same seed inside a batch with other (unseeded, sampled) requests draws the same tokens
    other = GenerationConfig(max_new_tokens=12, do_sample=True, ignore_eos=True)
    seeded = GenerationConfig(max_new_tokens=12, do_sample=True, temperature=1.0, random_seed=2, ignore_eos=True)
    batch = pipe(['noise', PROMPT_IDS, 'more noise'], [other, seeded, other])
    assert batch[1].token_ids == runs[2]


def test_top_k_1_sampling_equals_greedy(pipe):
    greedy = pipe(PROMPT_IDS, GREEDY).token_ids
    config = GenerationConfig(max_new_tokens=8, do_sample=True, temperature=1.5, top_k=1, ignore_eos=True)
    assert pipe(PROMPT_IDS, config).token_ids == greedy


@pytest.mark.parametrize('do_sample', [False, True], ids=['greedy', 'sampled'])
def test_logprobs_are_top_k_of_the_reference_log_softmax(pipe, hf_model, do_sample):
    k = 3
    config = GenerationConfig(max_new_tokens=6, do_sample=do_sample, random_seed=7, logprobs=k, ignore_eos=True)
    response = pipe(PROMPT_IDS, config)
    assert len(response.logprobs) == len(response.token_ids) == 6
    ref = _hf_logits(hf_model, PROMPT_IDS + response.token_ids).log_softmax(-1)
    for i, (token, entry) in enumerate(zip(response.token_ids, response.logprobs)):
        row = ref[len(PROMPT_IDS) - 1 + i]
        top = row.topk(k).indices.tolist()
        assert token in entry
        assert set(top) <= set(entry) and set(entry) <= set(top) | {token}, f'token {i}: {sorted(entry)} vs {top}'
        ids = sorted(entry)
        assert_close(torch.tensor([entry[t] for t in ids]), row[ids], what=f'logprobs of token {i}')
    if not do_sample:
        assert all(len(entry) == k for entry in response.logprobs)


# ---- bad input -------------------------------------------------------------------------------------------------
BAD_REQUESTS = {
    'empty-str': ('', None, 'the prompt is empty'),
    'empty-ids': ([], None, 'the prompt is empty'),
    'token-past-vocab': ([1, 2, 1024], None, r'token ids out of the vocabulary \[0, 1024\): \[1024\]'),
    'negative-token': ([-1, 2], None, r'out of the vocabulary .*\[-1\]'),
    'negative-max-new-tokens': ('hi', GenerationConfig(max_new_tokens=-1), 'max_new_tokens'),
    'top-p-zero': ('hi', GenerationConfig(top_p=0.0), 'top_p'),
    'stop-id-past-vocab': ('hi', GenerationConfig(stop_token_ids=[5000]), 'stop_token_ids outside the vocabulary'),
    'prompt-at-session-len': (list(range(SESSION_LEN)), None, f'session_len is {SESSION_LEN}'),
    'message-without-content': ([{'role': 'user'}], None, "needs 'role' and 'content'"),
    'not-a-prompt': (42, None, 'a prompt must be a str'),
    'empty-prompt-in-batch': (['fine', ''], None, 'the prompt is empty'),
    'bad-config-in-batch': (['fine', 'also fine'], [GenerationConfig(max_new_tokens=30, ignore_eos=True),
                                                    GenerationConfig(stop_token_ids=[4096])], 'stop_token_ids'),
}


@pytest.mark.parametrize('prompt,config,message', BAD_REQUESTS.values(), ids=BAD_REQUESTS.keys())
def test_bad_request_raises_value_error_and_pipeline_keeps_serving(pipe, prompt, config, message):
    with pytest.raises(ValueError, match=message):
        pipe(prompt, config)
    # nothing of the rejected call may still run or hold blocks
    assert not pipe.engine.has_work
    _assert_pool_free(pipe)
    response = pipe(PROMPT_IDS, GenerationConfig(max_new_tokens=2, ignore_eos=True))
    assert response.generate_token_len == 2
    _assert_pool_free(pipe)


BAD_ENGINE_CONFIGS = {
    'block_size-0': ({'block_size': 0}, 'block_size must be a positive int'),
    'kernel_block_size-3': ({'kernel_block_size': 3}, 'kernel_block_size must be a positive power of two'),
    'kernel_block_size-past-block': ({'block_size': 16, 'kernel_block_size': 32}, r'must divide block_size \(16\)'),
    'dtype-int8': ({'dtype': 'int8'}, "dtype must be one of .* got 'int8'"),
    'cache_max_entry_count-2': ({'cache_max_entry_count': 2}, r'cache_max_entry_count must be in \(0, 1\]'),
    'device-tpu': ({'device_type': 'tpu'}, 'device_type must be one of'),
    'session_len-0': ({'session_len': 0}, 'session_len'),
    'max_batch_size-0': ({'max_batch_size': 0}, 'max_batch_size'),
}


@pytest.mark.parametrize('overrides,message', BAD_ENGINE_CONFIGS.values(), ids=BAD_ENGINE_CONFIGS.keys())
def test_invalid_engine_config_raises_value_error_naming_the_field(overrides, message):
    with pytest.raises(ValueError, match=message):
        PytorchEngineConfig(**{'device_type': 'cpu', **overrides})


def test_missing_model_folder_raises_value_error(tmp_path):
    with pytest.raises(ValueError, match='not found: no such folder'):
        pipeline(str(tmp_path / 'nowhere'), _engine_config())


# ---- lifecycle -------------------------------------------------------------------------------------------------
def test_context_manager_stops_the_engine_loop(model_path):
    with pipeline(model_path, _engine_config()) as pipe:
        thread = pipe.async_engine._loop._thread
        assert thread.is_alive()
        assert pipe('hi', GenerationConfig(max_new_tokens=2)).finish_reason in ('stop', 'length')
    thread.join(timeout=5)
    assert not thread.is_alive()
    assert thread not in threading.enumerate()


def test_closing_a_stream_early_aborts_its_unfinished_requests(pipe, monkeypatch):
    finish_reasons: dict[int, str] = {}
    submit = pipe.async_engine.submit

    def spying_submit(request, callback):
        def spy(out):
            if out.finished:
                finish_reasons[request.index] = out.finish_reason
            callback(out)
        return submit(request, spy)

    monkeypatch.setattr(pipe.async_engine, 'submit', spying_submit)
    configs = [GenerationConfig(max_new_tokens=SESSION_LEN - 20, ignore_eos=True),
               GenerationConfig(max_new_tokens=1, ignore_eos=True)]
    stream = pipe.stream_infer([PROMPT_IDS, 'short'], configs)
    seen = {next(stream).index}
    while 1 not in seen:  # until the one-token request has finished
        seen.add(next(stream).index)
    stream.close()
    for _ in range(200):
        if len(finish_reasons) == 2 and not pipe.engine.has_work:
            break
        threading.Event().wait(0.02)
    assert finish_reasons == {0: 'abort', 1: 'length'}
    _assert_pool_free(pipe)


# ---- CLI -------------------------------------------------------------------------------------------------------
def test_demo_prints_every_turn_with_cached_tokens_and_latency(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv('LMDEPLOY_CACHE_DIR', str(tmp_path))
    assert cli_main(['demo', '--max-new-tokens', '4', '--num-gpu-blocks', '32']) == 0
    out = capsys.readouterr().out
    assert 'prefix caching: True' in out
    stats = re.findall(r'\[turn (\d)\] prompt tokens: (\d+)  cached tokens: (\d+)  generated: (\d+)  '
                       r'latency: [\d.]+ ms', out)
    assert [int(s[0]) for s in stats] == [1, 2, 3], out
    prompt_lens = [int(s[1]) for s in stats]
    assert prompt_lens == sorted(prompt_lens) and len(set(prompt_lens)) == 3  # each turn resends the history
    for _, prompt_len, cached, generated in stats:
        assert 0 <= int(cached) < int(prompt_len) and 0 <= int(generated) <= 4
    # prefix caching is on: the first turn finds nothing, the last reuses the history of the earlier turns
    assert int(stats[0][2]) == 0 and int(stats[2][2]) > 0
    for turn in (1, 2, 3):
        assert f'[turn {turn}] user: ' in out and f'[turn {turn}] assistant: ' in out
    # the demo checkpoint was built under the cache dir
    assert any(p.name.startswith('demo-qwen3') for p in tmp_path.iterdir())
