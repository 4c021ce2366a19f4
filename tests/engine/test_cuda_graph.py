"""CUDA graphs replayed against eager mode (GPU): decode batches and small prefills of changing size, long bf16
decodes, and hybrid prefill graphs up to 4096 tokens (warm start, bucket edges, prefix hits, recurrent state). The
CPU side of graphs: `test_cuda_graph_keys.py` (keys, buckets, policy) and `test_cuda_graph_static_inputs.py`
(the padding contract)."""
from __future__ import annotations

import time

import pytest
import torch

from lmdeploy.messages import PytorchEngineConfig
from lmdeploy.pytorch.engine.engine import Engine
from lmdeploy.pytorch.messages import SamplingParams


@pytest.fixture(scope='module', autouse=True)
def wide_chunked_prefill_graphs():
    """Every engine of this file: prefill graphs up to 4096 tokens, fla's chunked kernel inside them, each split
    into a chain of graphs after layers 1 and 3 (three pieces on the 4-layer hybrids, two on the 2-layer Qwen3;
    the default split, after 2 and 10 layers, runs in every other gpu test)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv('LMDEPLOY_PREFILL_GRAPH_TOKENS', '4096')
        mp.setenv('LMDEPLOY_GRAPH_GDR', 'chunked')
        mp.setenv('LMDEPLOY_GRAPH_SPLIT', '1,3')
        yield


def _generate(engine: Engine, prompts: list[list[int]], max_new_tokens: int, stagger: int = 0):
    """Greedy generation; request i joins after i * stagger steps, so decode batches change size over time."""
    outs: dict[int, list[int]] = {}
    ids: list[int] = []
    pending = list(prompts)
    steps = 0
    while pending or engine.has_work:
        while pending and len(ids) * stagger <= steps:
            ids.append(engine.add_request(pending.pop(0), SamplingParams(max_new_tokens=max_new_tokens),
                                          collect_logits=True,
                                          callback=lambda o: outs.setdefault(o.seq_id, []).extend(o.new_token_ids)))
        engine.step()
        engine.check_integrity()
        steps += 1
    return [(outs[i], engine.pop_collected_logits(i)) for i in ids]


def _assert_same_greedy_path(got, ref, tol: float, min_equal: int) -> None:
    """Graph and eager runs pad batches differently, so logits differ by rounding and greedy paths may part at a
    near-tie. Compare the logits of every step up to and including the first differing token (their inputs are
    identical, so a real replay bug shows there as a large error), and require the paths to agree for long."""
    compared = 0
    for (tokens, logits), (ref_tokens, ref_logits) in zip(got, ref):
        same = next((i for i, (a, b) in enumerate(zip(tokens, ref_tokens)) if a != b),
                    min(len(tokens), len(ref_tokens)))
        rows = min(logits.shape[0] - len(tokens) + same + 1, logits.shape[0], ref_logits.shape[0])
        err = (logits[:rows].float() - ref_logits[:rows].float()).abs().max().item()
        assert err < tol, f'graph vs eager logits differ by {err} (first differing token at {same})'
        compared += same
    assert compared >= min_equal, f'greedy paths parted too early ({compared} equal tokens in all)'


@pytest.mark.gpu
@pytest.mark.parametrize('arch,dtype', [('qwen3', 'float32'), ('qwen3_next', 'float32')])
@pytest.mark.parametrize('prefix_caching', [False, True])
def test_cuda_graphs_match_eager(tiny_model_factory, arch, dtype, prefix_caching):
    # Staggered arrivals with 48-token prefill chunks: decode batches of changing size replay decode graphs, and
    # small prefills / mixed batches of fewer than 8 sequences replay prefill graphs (pad sequence + empty ones)
    # where the policy allows them (dense models; hybrids on fla, i.e. bf16, which
    # test_hybrid_prefill_graphs_match_eager covers).
    from lmdeploy.pytorch.backends import cuda as cuda_backend
    path = tiny_model_factory(arch)
    g = torch.Generator().manual_seed(3)
    shared = torch.randint(0, 1000, (21,), generator=g).tolist()
    prompts = [shared + torch.randint(0, 1000, (n,), generator=g).tolist() for n in (1, 5, 9, 14, 30, 2, 7)]
    common = dict(device_type='cuda', dtype=dtype, block_size=16, kernel_block_size=8, num_gpu_blocks=128,
                  max_batch_size=8, max_prefill_token_num=48, enable_prefix_caching=prefix_caching)
    graphs = Engine(path, PytorchEngineConfig(**common))
    eager = Engine(path, PytorchEngineConfig(eager_mode=True, **common))
    assert eager.agent.graph_runner is None
    got = _generate(graphs, prompts, max_new_tokens=40, stagger=3)
    ref = _generate(eager, prompts, max_new_tokens=40, stagger=3)
    runner = graphs.agent.graph_runner
    assert runner.num_replays > 20 and len(runner.graphs) >= 3, (runner.num_replays, sorted(runner.graphs))
    prefill_graphs = cuda_backend.prefill_graphs_supported(getattr(torch, dtype), is_hybrid=arch != 'qwen3')
    assert (runner.num_prefill_replays > 0) == prefill_graphs, runner.num_prefill_replays
    # float32: a replay bug shows as an O(1) logit error; 2e-2 leaves room for GEMM kernels that differ between
    # padded and unpadded shapes. bf16 rounding is coarser.
    _assert_same_greedy_path(got, ref, tol=2e-2 if dtype == 'float32' else 0.1, min_equal=60)


@pytest.mark.gpu
@pytest.mark.parametrize('prefix_caching', [False, True])
def test_hybrid_prefill_graphs_match_eager(tiny_model_factory, prefix_caching):
    """Hybrid prefill graphs (bf16, fla): small prefills and mixed batches replay graphs with fla's chunked
    kernel inside (as eager prefills run it), and generation follows eager mode."""
    path = tiny_model_factory('qwen3_next')
    g = torch.Generator().manual_seed(5)
    shared = torch.randint(0, 1000, (21,), generator=g).tolist()
    prompts = [shared + torch.randint(0, 1000, (n,), generator=g).tolist() for n in (1, 5, 9, 14, 30, 2, 7)]
    common = dict(device_type='cuda', dtype='bfloat16', block_size=16, kernel_block_size=8, num_gpu_blocks=128,
                  max_batch_size=8, max_prefill_token_num=48, enable_prefix_caching=prefix_caching)
    graphs = Engine(path, PytorchEngineConfig(**common))
    got = _generate(graphs, prompts, max_new_tokens=40, stagger=3)
    ref = _generate(Engine(path, PytorchEngineConfig(eager_mode=True, **common)), prompts, max_new_tokens=40,
                    stagger=3)
    assert graphs.agent.graph_runner.num_prefill_replays > 0
    _assert_same_greedy_path(got, ref, tol=0.1, min_equal=60)


@pytest.mark.gpu
def test_cuda_graph_bf16_long_decode_crosses_pages(tiny_model_factory):
    """bf16 (fla recurrent kernel), decodes that cross many KV pages after capture: graphs replay the same tokens
    as eager mode."""
    path = tiny_model_factory('qwen3_5')
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 1000, (n,), generator=g).tolist() for n in (3, 17, 40)]
    common = dict(device_type='cuda', dtype='bfloat16', block_size=16, kernel_block_size=8, num_gpu_blocks=128,
                  max_batch_size=4)
    got = _generate(Engine(path, PytorchEngineConfig(**common)), prompts, max_new_tokens=100)
    ref = _generate(Engine(path, PytorchEngineConfig(eager_mode=True, **common)), prompts, max_new_tokens=100)
    _assert_same_greedy_path(got, ref, tol=0.1, min_equal=100)


# Tiny hybrids (3 gated DeltaNet : 1 attention; Qwen3.5 with a dense MLP, Qwen3-Next with MoE) with prefills up to
# 4096 tokens in one forward: graphs (warm start) against eager mode, same weights, prefix caching on. One pair of
# engines per (arch, dtype) for the whole module.
BUCKET_EDGE_LENS = [255, 256, 257, 767, 1024, 1025, 1536, 2049, 3583, 4095, 4096]


@pytest.fixture(scope='module', params=[('qwen3_5', 'bfloat16'), ('qwen3_5', 'float16'), ('qwen3_next', 'bfloat16')],
                ids=lambda p: '-'.join(p))
def hybrid_pair(request, tiny_model_factory):
    if not torch.cuda.is_available():
        pytest.skip('needs CUDA')
    pytest.importorskip('fla')
    arch, dtype = request.param
    path = tiny_model_factory(arch, max_position_embeddings=8192)
    common = dict(device_type='cuda', dtype=dtype, block_size=16, kernel_block_size=8, num_gpu_blocks=1536,
                  max_batch_size=8, max_prefill_token_num=4096, session_len=8192, enable_prefix_caching=True)
    start = time.perf_counter()
    graphs = Engine(path, PytorchEngineConfig(**common))
    startup = time.perf_counter() - start
    eager = Engine(path, PytorchEngineConfig(eager_mode=True, **common))
    return graphs, eager, dtype, startup, path


@pytest.fixture(scope='module')
def float32_truth(hybrid_pair):
    """The same checkpoint eagerly in float32 on CUDA (the exact torch gated delta rule): the yardstick for bf16 /
    fp16 rounding."""
    *_, path = hybrid_pair
    return Engine(path, PytorchEngineConfig(device_type='cuda', dtype='float32', block_size=16, kernel_block_size=8,
                                            num_gpu_blocks=1536, max_batch_size=8, max_prefill_token_num=4096,
                                            session_len=8192, eager_mode=True))


def _prompts(lens: list[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 1000, (n,), generator=g).tolist() for n in lens]


@pytest.mark.gpu
def test_warm_start_captures_every_prefill_bucket(hybrid_pair):
    """At start-up: decode graphs and one prefill graph per token bucket (one or two sequences), within a start-up
    that stays short for this tiny model."""
    from lmdeploy.pytorch.engine.cuda_graph import PREFILL_TOKEN_BUCKETS, prefill_warm_keys
    graphs, _, _, startup, _ = hybrid_pair
    runner = graphs.agent.graph_runner
    assert runner.token_buckets == PREFILL_TOKEN_BUCKETS
    warm = set(prefill_warm_keys(runner.token_buckets, runner.seq_buckets))
    assert warm <= set(runner.graphs) and not runner.failed
    assert runner.static.chunk_indices is not None   # hybrids on fla: the chunked kernel inside the graphs
    # prefill graphs are chains split after layers 1 and 3 (of 4); decode graphs stay whole
    from lmdeploy.pytorch.engine.graph_chain import GraphChain
    for key, (graph, _) in runner.graphs.items():
        assert (len(graph) if isinstance(graph, GraphChain) else 1) == (1 if key.decode else 3), key
    assert 0 < runner.capture_seconds < startup < 300


def _rms(x: torch.Tensor) -> float:
    return x.float().pow(2).mean().sqrt().item()


@pytest.mark.gpu
def test_prefills_at_bucket_edges_replay_warm_graphs_like_eager(hybrid_pair, float32_truth):
    """Lone prompts just below, at and above each bucket edge up to 4096 tokens: every prefill replays a graph
    captured at start-up (no capture on the request path).

    A prompt that fills its bucket runs the very kernels on the very shapes eager mode runs (no pad token), so its
    logits and tokens equal eager's (1e-2). A padded one runs GEMMs and MoE tiles of other row counts, whose bf16 /
    fp16 rounding differs; in the tiny MoE model that flips router near-ties at a few positions (whole rows of
    logits then differ by ~1, as between any two segmentations; see test_cuda_engine). So there: at most 1% of
    the prompt positions may differ from eager by more than 0.1, and the logits must be no further (RMS) from the
    float32 run than eager's are (2x margin). A replay bug (wrong state, KV or chunk indices) breaks every one."""
    graphs, eager, dtype, _, _ = hybrid_pair
    runner = graphs.agent.graph_runner
    captured, replays = set(runner.graphs), runner.num_prefill_replays
    report = {}
    for i, prompt in enumerate(_prompts(BUCKET_EDGE_LENS, seed=11)):
        got = _generate(graphs, [prompt], max_new_tokens=4)
        ref = _generate(eager, [prompt], max_new_tokens=4)
        n = len(prompt)
        assert runner.num_prefill_replays == replays + i + 1, f'prompt of {n} tokens ran eagerly'
        if n in runner.token_buckets:
            _assert_same_greedy_path(got, ref, tol=1e-2, min_equal=4)
            continue
        truth = _generate(float32_truth, [prompt], max_new_tokens=1)[0][1][:n].float()
        graph_rows, eager_rows = got[0][1][:n].float(), ref[0][1][:n].float()   # teacher-forced prompt positions
        far = ((graph_rows - eager_rows).abs().amax(dim=-1) > 0.1).sum().item()
        graph_rms, eager_rms = _rms(graph_rows - truth), _rms(eager_rows - truth)
        report[n] = f'{far} positions > 0.1 from eager; RMS vs fp32 graph {graph_rms:.3g}, eager {eager_rms:.3g}'
        assert far <= max(2, n // 100), f'{n} tokens: {report[n]}'
        assert graph_rms <= 2 * eager_rms + 1e-3, f'{n} tokens: {report[n]}'
    print(f'{dtype} bucket edges: {report}')
    assert set(runner.graphs) == captured


@pytest.mark.gpu
def test_batched_and_mixed_prefills_replay_like_eager(hybrid_pair):
    """Several prompts in one forward and staggered arrivals (prefill chunks beside decodes), up to 4096 tokens a
    forward: graphs captured on first use, then replayed, follow eager mode."""
    graphs, eager, _, _, _ = hybrid_pair
    runner = graphs.agent.graph_runner
    prompts = _prompts([700, 300, 1500, 64, 9, 2000, 130], seed=12)
    for stagger in (0, 2):
        got = _generate(graphs, prompts, max_new_tokens=12, stagger=stagger)
        ref = _generate(eager, prompts, max_new_tokens=12, stagger=stagger)
        _assert_same_greedy_path(got, ref, tol=0.1, min_equal=60)
    assert any(not k.decode and k.num_seqs >= 8 for k in runner.graphs)
    assert not runner.failed


def _generate_counting_hits(engine: Engine, prompt: list[int], max_new_tokens: int):
    cached, out = [], []
    seq_id = engine.add_request(prompt, SamplingParams(max_new_tokens=max_new_tokens), collect_logits=True,
                                callback=lambda o: (cached.append(o.num_cached), out.extend(o.new_token_ids)))
    while engine.has_work:
        engine.step()
    engine.check_integrity()
    return out, engine.pop_collected_logits(seq_id), max(cached)


@pytest.mark.gpu
def test_prefix_hit_with_unaligned_restore_replays_like_eager(hybrid_pair):
    """A 1000-token prompt (not block-aligned: its state checkpoint is at the prompt end), then that prompt plus
    300 tokens: the second request restores KV and state from the cache and prefills only the suffix through a
    graph (history longer than the bucket); tokens and logits follow eager mode, which restores the same way."""
    graphs, eager, _, _, _ = hybrid_pair
    prefix, suffix = _prompts([1000, 300], seed=13)
    results = []
    for engine in (graphs, eager):
        _generate_counting_hits(engine, prefix, 1)
        tokens, logits, cached = _generate_counting_hits(engine, prefix + suffix, 8)
        assert cached >= 992, cached   # a hit at (or after) the last full block
        results.append([(tokens, logits)])
    _assert_same_greedy_path(results[0], results[1], tol=0.1, min_equal=7)


@pytest.mark.gpu
def test_state_after_a_graph_prefill_equals_eager(hybrid_pair):
    """One packed prefill of three fresh sequences through `ModelAgent.forward_logits`: the graph engine runs it
    twice (on first use of its key: eager through the static buffers, then capture; then replay) and leaves the
    same logits and the same recurrent and conv state in the sequences' pool rows as the eager engine."""
    from lmdeploy.pytorch.messages import SchedulerSequence
    graphs, eager, dtype, _, _ = hybrid_pair
    results = []
    for engine, runs in ((graphs, 2), (eager, 1)):
        prompts = _prompts([300, 5, 1000], seed=14)
        seqs = [SchedulerSequence(seq_id=10_000 + i, token_ids=list(p), num_prompt_tokens=len(p),
                                  sampling=SamplingParams(max_new_tokens=1)) for i, p in enumerate(prompts)]
        for seq in seqs:
            engine.scheduler.add(seq)
        sched = engine.scheduler.schedule()
        assert sched.num_new_tokens == [len(p) for p in prompts]
        inputs, _ = engine.inputs_maker.make(sched)
        runner = engine.agent.graph_runner
        replays = runner.num_prefill_replays if runner else 0
        # an earlier test of the module may have captured this key already: then both runs replay
        first_use = runner is not None and runner.key_of(inputs) not in runner.graphs
        for _ in range(runs):
            logits, _ = engine.agent.forward_logits(inputs)
        if runs == 2:
            assert runner.num_prefill_replays == replays + runs - first_use
        rows = inputs.state_ids.tolist()
        states = [{name: pool[rows].float().cpu() for name, pool in layer.items()}
                  for layer in engine.cache_engine.state_caches]
        results.append((logits.float(), states))
        for seq in seqs:
            engine.scheduler.abort(seq)
        engine.check_integrity()
    (got_logits, got_states), (want_logits, want_states) = results
    torch.testing.assert_close(got_logits, want_logits, atol=0.1, rtol=0.05)
    for got, want in zip(got_states, want_states):
        for name in want:
            torch.testing.assert_close(got[name], want[name], atol=5e-2, rtol=5e-2, msg=name)


@pytest.mark.gpu
def test_a_failed_prefill_capture_leaves_later_captures_working(tiny_model_factory, monkeypatch):
    """The first prefill shape captured at start-up fails (a host read inside the capture, which CUDA refuses): that
    shape runs eagerly, torch's capture state is left clean (`cuda_graph.recover_from_failed_capture`: later graphs
    take a new pool, the CUDA generator's capture mark is cleared), and every later warm shape still captures;
    generation follows eager mode, the failed shape's prefill included, and a sampled request draws from the
    device's generator."""
    from lmdeploy.pytorch.engine import cuda_graph
    capture, broken = cuda_graph.CUDAGraphRunner._capture, []

    def capture_breaking_the_first_prefill(self, key, static_inputs):
        if key.decode or broken:
            return capture(self, key, static_inputs)
        broken.append(key)
        model = self.model

        def syncing(ctx):
            torch.ones(1, device=self.device).item()  # a synchronisation: not permitted while the stream captures
            return model(ctx)
        self.model = syncing
        try:
            return capture(self, key, static_inputs)
        finally:
            self.model = model
    monkeypatch.setattr(cuda_graph.CUDAGraphRunner, '_capture', capture_breaking_the_first_prefill)
    path = tiny_model_factory('qwen3_5')
    common = dict(device_type='cuda', dtype='bfloat16', block_size=16, kernel_block_size=8, num_gpu_blocks=128,
                  max_batch_size=8, max_prefill_token_num=48)
    graphs = Engine(path, PytorchEngineConfig(**common))
    runner = graphs.agent.graph_runner
    assert runner.failed == set(broken) and len(broken) == 1, (runner.failed, broken)
    warm = [k for k in runner.graphs if not k.decode]
    assert len(warm) >= 2, sorted(runner.graphs)  # the shapes after the failed one captured
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, 1000, (n,), generator=g).tolist() for n in (broken[0].num_tokens - 3, 5, 20)]
    got = _generate(graphs, prompts, max_new_tokens=12)
    ref = _generate(Engine(path, PytorchEngineConfig(eager_mode=True, **common)), prompts, max_new_tokens=12)
    assert runner.num_prefill_replays > 0
    _assert_same_greedy_path(got, ref, tol=0.1, min_equal=30)
    out = []
    graphs.add_request(prompts[1], SamplingParams(max_new_tokens=6, temperature=1.0, top_k=0),
                       callback=lambda o: out.extend(o.new_token_ids))
    while graphs.has_work:
        graphs.step()
    graphs.check_integrity()
    assert len(out) == 6, out
