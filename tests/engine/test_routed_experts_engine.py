"""Routed experts through the engine and the pipeline: `GenerationConfig.return_routed_experts` gives the final
`Response.routed_experts` [num_prompt + num_generated - 1, num_moe_layers, top_k] (uint16), checked against
transformers' router logits over the request's prompt and reply (teacher forced); the engine flag gates it."""
from __future__ import annotations

import numpy as np
import pytest
from routes_reference import (
    Finished,
    assert_routes_match,
    build_qwen3_5_moe,
    build_qwen3_next,
    prompt,
    reference_routes,
)

from lmdeploy.messages import GenerationConfig, PytorchEngineConfig
from lmdeploy.pytorch.engine.engine import Engine
from lmdeploy.pytorch.messages import SamplingParams
from lmdeploy.serve.pipeline import Pipeline


def engine_config(**overrides) -> PytorchEngineConfig:
    config = dict(device_type='cpu', block_size=16, kernel_block_size=8, num_gpu_blocks=64, max_batch_size=8,
                  max_prefill_token_num=256, enable_return_routed_experts=True)
    config.update(overrides)
    return PytorchEngineConfig(**config)


@pytest.fixture(scope='module')
def qwen3_next(tiny_model_factory):
    return build_qwen3_next(tiny_model_factory)


@pytest.fixture(scope='module')
def qwen3_5_moe(tmp_path_factory):
    return build_qwen3_5_moe(str(tmp_path_factory.mktemp('qwen3_5_moe')))


def run(engine: Engine, requests: list[tuple[list[int], SamplingParams]]) -> list[Finished]:
    outs = []
    for token_ids, params in requests:
        outs.append(Finished())
        engine.add_request(token_ids, params, callback=outs[-1])
    while engine.has_work:
        engine.step()
        engine.check_integrity()
    return outs


def greedy(n: int, routed: bool = True) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, return_routed_experts=routed)


@pytest.mark.parametrize('name', ['qwen3_next', 'qwen3_5_moe'])
def test_prompt_and_reply_routes_match_transformers(request, name):
    # chunked prefill (7-token pieces), batched decode, and a request that did not ask in the same batches
    path, model = request.getfixturevalue(name)
    engine = Engine(path, engine_config(max_prefill_token_num=7))
    vocab, config = engine.model_config.vocab_size, engine.model_config
    prompts = [prompt(19, seed=1, vocab=vocab), prompt(5, seed=2, vocab=vocab), prompt(9, seed=3, vocab=vocab)]
    outs = run(engine, [(prompts[0], greedy(6)), (prompts[1], greedy(4)), (prompts[2], greedy(5, routed=False))])
    compared = 0
    for p, out in zip(prompts[:2], outs[:2]):
        tokens = p + out.tokens
        routes = out.final.routed_experts
        assert routes.shape == (len(tokens) - 1, config.num_moe_layers, config.moe_top_k)
        compared += assert_routes_match(routes, reference_routes(model, tokens[:-1]), config.moe_top_k)
    assert compared > 0.8 * (18 + 4 + 4 + 3) * config.num_moe_layers
    assert outs[2].final.routed_experts is None


def test_routes_survive_preemption(qwen3_next):
    path, _ = qwen3_next
    prompts = [prompt(10, seed=30 + i) for i in range(3)]
    expected = run(Engine(path, engine_config(block_size=8)), [(p, greedy(12)) for p in prompts])
    # 6 blocks of 8 tokens: all three are admitted, then growing past 16 tokens forces preemption (recompute)
    engine = Engine(path, engine_config(block_size=8, kernel_block_size=4, num_gpu_blocks=6))
    outs = []
    for p in prompts:
        outs.append(Finished())
        engine.add_request(p, greedy(12), callback=outs[-1])
    engine.step()
    seqs = list(engine.scheduler.running)
    while engine.has_work:
        engine.step()
        engine.check_integrity()
    assert sum(seq.num_preemptions for seq in seqs) > 0
    for got, want in zip(outs, expected):
        assert got.tokens == want.tokens
        np.testing.assert_array_equal(got.final.routed_experts, want.final.routed_experts)


def test_asking_without_the_engine_flag_is_refused(qwen3_next):
    path, _ = qwen3_next
    engine = Engine(path, engine_config(enable_return_routed_experts=False))
    with pytest.raises(ValueError, match='enable_return_routed_experts'):
        engine.add_request(prompt(5, seed=4), greedy(2))
    out, = run(engine, [(prompt(5, seed=4), greedy(2, routed=False))])  # the engine keeps serving
    assert len(out.tokens) == 2 and out.final.routed_experts is None


def test_requests_that_do_not_ask_record_nothing(qwen3_next):
    path, _ = qwen3_next
    engine = Engine(path, engine_config())
    forwards = []
    forward = engine.agent.forward

    def recording_forward(inputs, *args):
        forwards.append(inputs.record_routed_experts)
        return forward(inputs, *args)
    engine.agent.forward = recording_forward
    engine.add_request(prompt(6, seed=5), greedy(3, routed=False))
    engine.step()
    assert engine.scheduler.running[0].routed_experts is None
    engine.run_until_idle()
    assert forwards == [False] * 3


def test_a_dense_model_returns_no_layer_column(tiny_model_factory):
    engine = Engine(tiny_model_factory('qwen3_5'), engine_config())
    p = prompt(7, seed=6)
    out, = run(engine, [(p, greedy(3))])
    routes = out.final.routed_experts
    assert routes.dtype == np.uint16 and routes.shape == (len(p) + 3 - 1, 0, 0)


def test_an_aborted_request_returns_the_rows_it_computed(qwen3_next):
    path, model = qwen3_next
    engine = Engine(path, engine_config())
    p = prompt(8, seed=7)
    out = Finished()
    seq_id = engine.add_request(p, greedy(50), callback=out)
    for _ in range(3):  # prefill, then two decodes
        engine.step()
    engine.abort_request(seq_id)
    engine.run_until_idle()
    routes = out.final.routed_experts
    assert routes.shape[0] == len(p) + 2
    assert_routes_match(routes, reference_routes(model, (p + out.tokens)[:len(p) + 2]), 2)


def test_a_request_aborted_while_preempted_returns_the_rows_it_computed(qwen3_next):
    # a server's stop string aborts a request a step or two late: it may be preempted (num_computed 0) by then
    path, model = qwen3_next
    engine = Engine(path, engine_config())
    p = prompt(8, seed=7)
    out = Finished()
    seq_id = engine.add_request(p, greedy(50), callback=out)
    for _ in range(3):  # prefill, then two decodes: rows of 8 + 2 positions
        engine.step()
    seq, = engine.scheduler.running
    engine.scheduler.preempt(seq)
    engine.abort_request(seq_id)
    engine.run_until_idle()
    engine.check_integrity()
    routes = out.final.routed_experts
    assert routes.shape[0] == len(p) + 2
    assert_routes_match(routes, reference_routes(model, (p + out.tokens)[:len(p) + 2]), 2)


def test_pipeline_returns_routes_in_the_final_response(qwen3_5_moe):
    path, model = qwen3_5_moe
    with Pipeline(path, engine_config()) as pipe:
        gen = GenerationConfig(max_new_tokens=4, ignore_eos=True, return_routed_experts=True)
        response = pipe([5, 17, 42, 99, 3, 8], gen)
        streamed = list(pipe.stream_infer([[5, 17, 42, 99, 3, 8]], gen))
        plain = pipe([5, 17, 42], GenerationConfig(max_new_tokens=2, ignore_eos=True))
    tokens = [5, 17, 42, 99, 3, 8] + response.token_ids
    assert response.routed_experts.shape == (len(tokens) - 1, 3, 3)
    assert_routes_match(response.routed_experts, reference_routes(model, tokens[:-1]), 3)
    assert [r.routed_experts is None for r in streamed] == [True] * (len(streamed) - 1) + [False]
    np.testing.assert_array_equal(streamed[-1].routed_experts, response.routed_experts)
    assert plain.routed_experts is None


def test_pipeline_refuses_routes_without_the_engine_flag(tiny_model_factory):
    with Pipeline(tiny_model_factory('qwen3_next'), engine_config(enable_return_routed_experts=False)) as pipe:
        with pytest.raises(ValueError, match='enable_return_routed_experts'):
            pipe([1, 2, 3], GenerationConfig(max_new_tokens=2, return_routed_experts=True))


def test_cli_flag_sets_the_engine_config():
    import argparse

    from lmdeploy.cli.engine_args import add_engine_args, engine_config_from_args
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_config_from_args(parser.parse_args(['--enable-return-routed-experts'])).enable_return_routed_experts
    assert not engine_config_from_args(parser.parse_args([])).enable_return_routed_experts


@pytest.mark.gpu
@pytest.mark.parametrize('eager', [False, True], ids=['graphs', 'eager'])
def test_cuda_routes_match_the_cpu_engine(qwen3_next, eager):
    # The reference is the CPU engine (default backend), whose routes the CPU tests check against transformers:
    # transformers itself cannot be the reference here, since with fla-core installed it binds fla's kernels, which
    # fail on CPU tensors. float32 on both sides; with graphs, decodes replay captured graphs that record into the
    # static routes buffer. The CPU engine is teacher-forced on the GPU run's tokens.
    path, _ = qwen3_next
    engine = Engine(path, engine_config(device_type='cuda', dtype='float32', eager_mode=eager))
    prompts = [prompt(19, seed=1), prompt(5, seed=2), prompt(9, seed=3)]
    outs = run(engine, [(p, greedy(6, routed=i != 2)) for i, p in enumerate(prompts)])
    if not eager:
        assert engine.agent.graph_runner.num_replays > 0
    cpu = Engine(path, engine_config())
    for p, out in zip(prompts[:2], outs[:2]):
        tokens = p + out.tokens
        ref = run(cpu, [(tokens[:-1], greedy(1))])[0].final.routed_experts
        got = out.final.routed_experts
        assert got.shape == ref.shape == (len(tokens) - 1, 3, 2)
        assert (np.sort(got, axis=-1) == np.sort(ref, axis=-1)).all()
    assert outs[2].final.routed_experts is None
