"""CUDA graphs (decode batches and small prefills): padding contract (CPU) and replay against eager mode (GPU)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from lmdeploy.messages import PytorchEngineConfig
from lmdeploy.pytorch.engine.cuda_graph import GraphKey, _StaticInputs, capture_sizes
from lmdeploy.pytorch.engine.engine import Engine
from lmdeploy.pytorch.messages import SamplingParams
from lmdeploy.pytorch.model_inputs import ModelInputs


def test_capture_sizes():
    assert capture_sizes(1) == [1]
    assert capture_sizes(5) == [1, 2, 4, 5]
    assert capture_sizes(16) == [1, 2, 4, 8, 16]
    assert capture_sizes(40) == [1, 2, 4, 8, 16, 32, 40]
    assert capture_sizes(128)[-3:] == [96, 112, 128]


def _decode_inputs(batch: int, width: int) -> ModelInputs:
    ar = torch.arange(batch, dtype=torch.int64)
    return ModelInputs(
        input_ids=ar + 100, position_ids=ar + 10, q_lens=torch.ones(batch, dtype=torch.int64), kv_lens=ar + 11,
        cu_seqlens_q=torch.arange(batch + 1), block_tables=(ar[:, None] * width + torch.arange(width)) + 1,
        slot_mapping=ar * 64 + 5, logits_indices=ar, state_ids=ar + 1, is_fresh=torch.zeros(batch, dtype=torch.bool),
        q_lens_list=[1] * batch, kv_lens_list=(ar + 11).tolist(), max_seqlen_q=1, max_seqlen_k=batch + 10)


def test_static_inputs_pad_rows_are_inert():
    """Rows past the batch must be padding the kernels ignore: kv_len 0, KV slot -1, dummy state row 0."""
    static = _StaticInputs(max_tokens=8, max_seqs=8, max_pages=6, device=torch.device('cpu'))
    static.fill_decode(_decode_inputs(7, 6), 8)     # a large batch first leaves non-padding values behind
    static.fill_decode(_decode_inputs(3, 2), 4)
    view = static.view(GraphKey(4, 4, True))
    assert view.input_ids.tolist() == [100, 101, 102, 0]
    assert view.position_ids.tolist() == [10, 11, 12, 0]
    assert view.kv_lens.tolist() == [11, 12, 13, 0]
    assert view.slot_mapping.tolist() == [5, 69, 133, -1]
    assert view.state_ids.tolist() == [1, 2, 3, 0]
    assert view.block_tables[:3, :2].tolist() == [[1, 2], [3, 4], [5, 6]]
    assert view.cu_seqlens_q.tolist() == [0, 1, 2, 3, 4] and view.is_decode and view.batch_size == 4


def test_cpu_agent_has_no_graphs(tiny_model_factory):
    engine = Engine(tiny_model_factory('qwen3_5'), PytorchEngineConfig(device_type='cpu', num_gpu_blocks=32))
    assert engine.agent.graph_runner is None


def test_prefill_graph_policy():
    """Prefill graphs for dense models, and for hybrids whose token-by-token gated delta rule is one fused fla
    launch (bf16 / fp16 with fla-core installed); not for the torch kernels' per-token loop (float32)."""
    from lmdeploy.pytorch.backends import cuda as cuda_backend
    assert cuda_backend.prefill_graphs_supported(torch.float32, is_hybrid=False)
    assert cuda_backend.prefill_graphs_supported(torch.bfloat16, is_hybrid=False)
    assert not cuda_backend.prefill_graphs_supported(torch.float32, is_hybrid=True)
    assert cuda_backend.prefill_graphs_supported(torch.bfloat16, is_hybrid=True) == cuda_backend._fla_available()


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


def _recurrent_everywhere(monkeypatch) -> None:
    """Eager prefills run the token-by-token gated delta rule too (as prefill graphs do), so a graphs-vs-eager
    comparison in bf16 isolates the graphs: chunked vs token-by-token bf16 rounding (the kernel tests' business)
    would otherwise part greedy paths of the tiny random models within a few dozen tokens."""
    from lmdeploy.pytorch.engine import inputs_maker
    make = inputs_maker.InputsMaker.make

    def make_recurrent(self, sched):
        inputs, sampled = make(self, sched)
        return dataclasses.replace(inputs, use_recurrent_kernel=True), sampled
    monkeypatch.setattr(inputs_maker.InputsMaker, 'make', make_recurrent)


@pytest.mark.gpu
@pytest.mark.parametrize('prefix_caching', [False, True])
def test_hybrid_prefill_graphs_match_eager(tiny_model_factory, monkeypatch, prefix_caching):
    """Hybrid prefill graphs (bf16, fla): small prefills and mixed batches replay graphs with fla's token-by-token
    kernel inside, and generation follows eager mode."""
    _recurrent_everywhere(monkeypatch)
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
def test_cuda_graph_bf16_long_decode_crosses_pages(tiny_model_factory, monkeypatch):
    """bf16 (fla recurrent kernel), decodes that cross many KV pages after capture: graphs replay the same tokens
    as eager mode."""
    _recurrent_everywhere(monkeypatch)
    path = tiny_model_factory('qwen3_5')
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 1000, (n,), generator=g).tolist() for n in (3, 17, 40)]
    common = dict(device_type='cuda', dtype='bfloat16', block_size=16, kernel_block_size=8, num_gpu_blocks=128,
                  max_batch_size=4)
    got = _generate(Engine(path, PytorchEngineConfig(**common)), prompts, max_new_tokens=100)
    ref = _generate(Engine(path, PytorchEngineConfig(eager_mode=True, **common)), prompts, max_new_tokens=100)
    _assert_same_greedy_path(got, ref, tol=0.1, min_equal=100)


def test_static_inputs_prefill_padding():
    """A prefill bucket: real sequences, then one pad sequence with the pad tokens, then empty sequences."""
    static = _StaticInputs(max_tokens=32, max_seqs=8, max_pages=6, device=torch.device('cpu'))
    static.fill_decode(_decode_inputs(7, 6), 8)   # leave non-padding values behind
    lens = [5, 9]
    inputs = ModelInputs(
        input_ids=torch.arange(14) + 1, position_ids=torch.arange(14) + 3, q_lens=torch.tensor(lens),
        kv_lens=torch.tensor([8, 20]), cu_seqlens_q=torch.tensor([0, 5, 14]),
        block_tables=torch.tensor([[1, 2, 0], [3, 4, 5]]), slot_mapping=torch.arange(14) + 40,
        logits_indices=torch.tensor([4, 13]), state_ids=torch.tensor([2, 3]), is_fresh=torch.tensor([False, True]),
        q_lens_list=lens, kv_lens_list=[8, 20], max_seqlen_q=9, max_seqlen_k=20)
    key = GraphKey(16, 4, False)
    static.fill_prefill(inputs, key)
    view = static.view(key)
    assert view.input_ids.tolist() == list(range(1, 15)) + [0, 0]
    assert view.slot_mapping.tolist()[12:] == [52, 53, -1, -1]
    assert view.q_lens.tolist() == [5, 9, 2, 0] and view.kv_lens.tolist() == [8, 20, 2, 0]
    assert view.cu_seqlens_q.tolist() == [0, 5, 14, 16, 16]
    assert view.state_ids.tolist() == [2, 3, 0, 0] and view.is_fresh.tolist() == [False, True, True, True]
    assert view.use_recurrent_kernel and view.max_seqlen_q == 16 and not view.is_decode
    # and back to a decode batch: sequence buffers are reset to one token per row
    static.fill_decode(_decode_inputs(3, 2), 4)
    view = static.view(GraphKey(4, 4, True))
    assert view.q_lens.tolist() == [1, 1, 1, 1] and view.cu_seqlens_q.tolist() == [0, 1, 2, 3, 4]
    assert view.kv_lens.tolist() == [11, 12, 13, 0] and view.is_fresh.tolist() == [False] * 4


def test_graph_keys():
    from lmdeploy.pytorch.engine.cuda_graph import CUDAGraphRunner
    runner = CUDAGraphRunner(None, None, max_batch_size=40, max_pages=6, device=torch.device('cpu'))
    assert runner.key_of(_decode_inputs(3, 2)) == GraphKey(4, 4, True)
    assert runner.key_of(_decode_inputs(33, 2)) == GraphKey(40, 40, True)
    assert runner.key_of(_decode_inputs(3, 7)) is None            # wider block table than the buffers
    prefill = dataclasses.replace(_decode_inputs(3, 2), input_ids=torch.zeros(70, dtype=torch.int64),
                                  max_seqlen_q=60)
    assert runner.key_of(prefill) == GraphKey(128, 4, False)
    assert runner.key_of(dataclasses.replace(prefill, input_ids=torch.zeros(300, dtype=torch.int64))) is None
    eight = dataclasses.replace(_decode_inputs(8, 2), input_ids=torch.zeros(20, dtype=torch.int64), max_seqlen_q=9)
    assert runner.key_of(eight) is None                            # no sequence bucket leaves room for the pad
