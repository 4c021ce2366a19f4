"""Speculative (MTP) steps through CUDA graphs (`engine/spec_graphs.py`), against eager speculative decoding and plain
decoding of the same checkpoint (plain decoding is itself tested against transformers elsewhere).

- CPU: no graph can be captured, so the verify forward, the draft head and the target's other forwards run eagerly
  *through the graphs' padded static buffers* (what a replay reads). This checks the padding contracts: greedy
  tokens equal plain decoding's, logits within tolerance, the recurrent state after every step equals plain
  decoding's under forced acceptance of every count, prefix-cache hits at unaligned steps stay exact, and the
  integrity check holds after every step and after aborts mid-verify. The greedy chain graph (`spec_chain`, on by
  default on CUDA, off with `LMDEPLOY_SPEC_CHAIN_GRAPH=0`) is forced on here through `_through_static_buffers`.
- GPU: the engine's own graphs (the default on CUDA). Graph replay gives the tokens and logits of eager
  speculative decoding (`eager_mode=True`) and of plain decoding, with prefix-cache hits at unaligned steps, and
  aborts mid-verify leak nothing; the chain graph (the default) drafts as the step-by-step chain (`=0`).
"""
from __future__ import annotations

import pytest
import torch
from mtp_runs import (
    ATOL,
    DraftRecorder,
    K,
    assert_pools_returned,
    check_resume_at_reply_checkpoint,
    forced_acceptance_states,
    greedy,
    make_engine,
    mtp_spec,
    num_free,
    on_device,
    random_prompt,
    record_hits,
    run_to_idle,
)

from lmdeploy.pytorch.engine.cuda_graph import CUDAGraphRunner
from lmdeploy.pytorch.engine.spec_chain import DraftChainGraphs, build_chain_graphs, chain_graph_enabled
from lmdeploy.pytorch.engine.spec_graphs import HeadGraphs, VerifyGraphRunner
from lmdeploy.pytorch.engine.spec_inputs import plan_chain
from lmdeploy.pytorch.messages import SamplingParams

pytest.importorskip('transformers')


class _Counted:
    """Counts calls of a bound method (replaced on its instance)."""

    def __init__(self, owner, name: str):
        self.fn, self.calls = getattr(owner, name), 0
        setattr(owner, name, self)

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.fn(*args, **kwargs)


def _eager_on_static_buffers(runner: CUDAGraphRunner) -> None:
    """`runner.run` without capturing: fill the static buffers, run the model on the graph's view eagerly, with the
    padded batch's real host lengths (the default backend reads them; a graph's kernels read device tensors)."""
    def run(inputs, key=None):
        key = key or runner.key_of(inputs)
        runner._fill(inputs, key)
        view = runner.static.view(key)
        rest = key.num_seqs - inputs.batch_size
        if key.decode:
            q, kv = [1] * key.num_seqs, inputs.kv_lens_list + [0] * rest
        else:
            pad = key.num_tokens - inputs.input_ids.numel()
            q = inputs.q_lens_list + [pad] + [0] * (rest - 1)
            kv = inputs.kv_lens_list + [pad] + [0] * (rest - 1)
        view.q_lens_list, view.kv_lens_list, view.max_seqlen_q, view.max_seqlen_k = q, kv, max(q), max(kv)
        return runner.model(runner._context(view))[:inputs.input_ids.numel()]
    runner.run = run


def _through_static_buffers(engine, chain: bool = True):
    """Give a CPU speculative engine the graph runners of a CUDA one, never capturing: every forward they support
    runs eagerly on their padded static buffers (`chain=False`: no greedy-chain graph, as with
    LMDEPLOY_SPEC_CHAIN_GRAPH=0). Returns call counters of the verify, head and chain runners."""
    agent, cfg = engine.agent, engine.model_config
    batch = engine.scheduler_config.max_batch_size
    kbs = engine.cache_config.kernel_block_size
    pages = -(-engine.session_len // kbs)
    dtype = getattr(torch, cfg.dtype)
    agent.verify_graphs = VerifyGraphRunner(agent.model.pre_norm_hidden, agent._context, batch, pages, K,
                                            agent.device)
    agent.head_graphs = HeadGraphs(agent.model, agent._context, batch, pages, K, cfg.hidden_size, dtype, agent.device)
    agent.chain_graphs = DraftChainGraphs(agent.model, agent._context, batch, pages, K, cfg.hidden_size, dtype,
                                          agent.device, kernel_block_size=kbs) if chain else None
    agent.graph_runner = CUDAGraphRunner(agent.model.pre_norm_hidden, agent._context, batch, pages, agent.device,
                                         max_prefill_tokens=64)
    for runner in (agent.head_graphs.runner, agent.graph_runner):
        _eager_on_static_buffers(runner)
    agent._graphs_pre_norm = True
    return (_Counted(agent.verify_graphs, 'run'), _Counted(agent.head_graphs.runner, 'run'),
            _Counted(agent.chain_graphs, 'run') if chain else None)


@pytest.mark.parametrize('name', ['qwen3_5', 'qwen3_next'])
def test_padded_static_buffers_give_plain_greedy_tokens_and_logits(mtp_model, name):
    path = mtp_model(name)
    prompts = [random_prompt(21, 0), random_prompt(35, 1), random_prompt(9, 2)]  # 3 rows pad to a verify graph of 4
    plain, plain_logits = run_to_idle(make_engine(path), prompts, greedy(14), collect=True)
    eager = make_engine(path, speculative_config=mtp_spec())
    eager.speculative.set_draft_override(eager_drafts := DraftRecorder())
    assert run_to_idle(eager, prompts, greedy(14)) == plain
    for chain in (True, False):  # the greedy chain in one graph, and step by step through the head's graphs
        engine = make_engine(path, speculative_config=mtp_spec())
        verify, head, chained = _through_static_buffers(engine, chain=chain)
        engine.speculative.set_draft_override(drafts := DraftRecorder())
        spec, spec_logits = run_to_idle(engine, prompts, greedy(14), collect=True)
        assert spec == plain
        for got, want in zip(spec_logits, plain_logits):
            torch.testing.assert_close(got, want, atol=ATOL, rtol=ATOL)
        assert drafts.proposals == eager_drafts.proposals  # the head through its static buffers drafts as eagerly
        if chain:  # every step's drafts came from one chain run; the head's runner ran the catch-ups only
            assert verify.calls > 0 and chained.calls >= verify.calls and head.calls > 0
        else:
            assert verify.calls > 0 and head.calls > verify.calls  # the catch-up and the chained drafts


def test_greedy_chain_derives_the_rows_plan_chain_builds_on_the_host(mtp_model):
    """The chain graph gets chained step 1's rows only; every later step's positions, KV slots and lengths (derived
    on the device) equal `plan_chain`'s for that step, its tokens are the previous round's drafts, and padding rows
    write no KV and read none."""
    engine = make_engine(mtp_model(), speculative_config=mtp_spec())
    _through_static_buffers(engine)
    spec, agent, maker = engine.speculative, engine.agent, engine.inputs_maker
    planned, checked = [], []
    chains_of, draft = spec._chains, agent.draft

    def record(drafting, params):
        planned.append(list(drafting))
        return chains_of(drafting, params)

    def check(*args, greedy_chain=False, **kw):
        pending = draft(*args, greedy_chain=greedy_chain, **kw)
        ids, _ = pending.resolve()
        if greedy_chain:
            seqs, size = planned[-1], agent.chain_graphs.size_of(len(planned[-1]), 1)
            for step in range(1, K):
                want = plan_chain(seqs, step, maker.page_table, maker.kernel_block_size)
                got = {name: t[:size].tolist() for name, t in agent.chain_graphs.steps[step - 1].items()}
                pad = size - len(seqs)
                assert got['position_ids'] == want.position_ids.tolist() + [0] * pad
                assert got['slot_mapping'] == want.slot_mapping.tolist() + [-1] * pad
                assert got['kv_lens'] == want.kv_lens.tolist() + [0] * pad
                assert got['input_ids'] == [row[step - 1] for row in ids] + [0] * pad
            checked.append(len(seqs))
        return pending
    spec._chains, agent.draft = record, check
    prompts = [random_prompt(21, 0), random_prompt(30, 3), random_prompt(12, 4)]
    run_to_idle(engine, prompts, greedy(10))  # 3 drafting rows pad to 4
    assert 3 in checked


def test_chain_graph_switch_and_sampled_drafts_take_the_step_by_step_chain(mtp_model, monkeypatch):
    """The chain graph is on by default (`LMDEPLOY_SPEC_CHAIN_GRAPH` unset or `1`); `0` builds none; a step where a
    sampled request drafts runs the chain step by step (it needs the head's distributions), and the greedy request
    beside it still decodes as plain."""
    for value in (None, '1'):
        if value is None:
            monkeypatch.delenv('LMDEPLOY_SPEC_CHAIN_GRAPH', raising=False)
        else:
            monkeypatch.setenv('LMDEPLOY_SPEC_CHAIN_GRAPH', value)
        assert chain_graph_enabled()
    monkeypatch.setenv('LMDEPLOY_SPEC_CHAIN_GRAPH', '0')
    assert not chain_graph_enabled() and build_chain_graphs(None, None, None, 4, 8, K, torch.device('cpu')) is None
    monkeypatch.delenv('LMDEPLOY_SPEC_CHAIN_GRAPH')
    path = mtp_model()
    prompts = [random_prompt(21, 0), random_prompt(17, 5)]
    (want,) = run_to_idle(make_engine(path), prompts[:1], greedy(12))
    engine = make_engine(path, speculative_config=mtp_spec())
    _, head, chained = _through_static_buffers(engine)
    tokens = {}
    ids = [engine.add_request(p, s, callback=lambda o: tokens.setdefault(o.seq_id, []).extend(o.new_token_ids))
           for p, s in zip(prompts, (greedy(12), SamplingParams(max_new_tokens=6, temperature=0.8, top_k=20)))]
    calls = []
    while engine.has_work:
        engine.step()
        engine.check_integrity()
        calls.append(chained.calls)
    assert tokens[ids[0]] == want and len(tokens[ids[1]]) == 6
    assert calls[2] == 0 and calls[-1] > 0  # mixed steps: step by step; once the sampled request ends: the graph


def test_padded_verify_leaves_the_plain_decode_state_for_every_acceptance_count(mtp_model):
    _, (verify, _, _) = forced_acceptance_states(mtp_model(), prepare=_through_static_buffers)
    assert verify.calls >= 8


def _unaligned_hits(engine_of, path: str) -> None:
    """Request 2 extends request 1's prompt (37 tokens: an unaligned prompt-end checkpoint) and resumes there; a
    third resumes at request 1's reply checkpoint. Tokens and logits equal plain decoding without a cache."""
    first = random_prompt(37, 7)
    second = first + random_prompt(6, 8)
    plain = [run_to_idle(engine_of(path), [p], greedy(10), collect=True) for p in (first, second)]
    engine = engine_of(path, cache=True, speculative_config=mtp_spec())
    assert run_to_idle(engine, [first], greedy(10)) == plain[0][0]
    hits = []
    out, (logits,) = run_to_idle(engine, [second], greedy(10), collect=True, after_step=record_hits(hits))
    assert out == plain[1][0] and hits and hits[0] == len(first)
    tol = ATOL if engine.device.type == 'cpu' else 10 * ATOL
    torch.testing.assert_close(logits, plain[1][1][0][len(first):], atol=tol, rtol=tol)
    check_resume_at_reply_checkpoint(engine, engine_of(path), first, plain[0][0][0], tol)


def _aborts_mid_verify_leak_nothing(engine) -> None:
    free = num_free(engine)
    ids = [engine.add_request(random_prompt(20, 12 + i), greedy(30)) for i in range(3)]
    for _ in range(3):
        engine.step()
        engine.check_integrity()
    assert all(engine._seqs[i][0].draft_ids for i in ids)  # drafts in flight: the next step verifies them
    engine.abort_request(ids[1])
    engine.step()
    engine.check_integrity()
    for i in ids:
        engine.abort_request(i)
    engine.run_until_idle()
    engine.check_integrity()
    assert_pools_returned(engine, free)


def test_padded_static_buffers_are_exact_on_unaligned_prefix_cache_hits(mtp_model):
    def engine_of(path, speculative_config=None, **kw):
        engine = make_engine(path, speculative_config=speculative_config, **kw)
        if speculative_config is not None:
            _through_static_buffers(engine)
        return engine
    _unaligned_hits(engine_of, mtp_model())


def test_aborts_mid_verify_through_static_buffers_leak_nothing(mtp_model):
    engine = make_engine(mtp_model(), cache=True, speculative_config=mtp_spec())
    _through_static_buffers(engine)
    _aborts_mid_verify_leak_nothing(engine)


# ---- on the GPU: real graphs ---------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize('name', ['qwen3_5', 'qwen3_next'])
def test_graph_replay_of_speculative_steps_equals_eager_and_plain(mtp_model, name):
    path = mtp_model(name)
    prompts = [random_prompt(21, 0), random_prompt(35, 1), random_prompt(9, 2)]
    plain, plain_logits = run_to_idle(make_engine(path, **on_device('cuda')), prompts, greedy(14), collect=True)
    eager_engine = make_engine(path, speculative_config=mtp_spec(), **on_device('cuda', eager_mode=True))
    eager, eager_logits = run_to_idle(eager_engine, prompts, greedy(14), collect=True)
    engine = make_engine(path, speculative_config=mtp_spec(), **on_device('cuda'))
    graphs, graph_logits = run_to_idle(engine, prompts, greedy(14), collect=True)
    assert graphs == eager == plain
    for got, eager_row, want in zip(graph_logits, eager_logits, plain_logits):
        # CUDA: the padded graph's GEMMs see other row counts than eager's, and a K + 1 token verify runs other
        # kernels than decode (the tolerance of test_mtp_engine's CUDA comparison)
        torch.testing.assert_close(got, eager_row, atol=10 * ATOL, rtol=10 * ATOL)
        torch.testing.assert_close(got, want, atol=10 * ATOL, rtol=10 * ATOL)
    agent = engine.agent
    assert agent.verify_graphs.num_replays > 0 and agent.head_graphs.runner.num_replays > 0


@pytest.mark.gpu
def test_greedy_chain_graph_drafts_as_the_step_by_step_chain(mtp_model, monkeypatch):
    """The greedy chain in one replay (the default, `LMDEPLOY_SPEC_CHAIN_GRAPH=1`, with the packed uploads) proposes
    exactly the drafts of the step-by-step chain through the head's graphs (`0`), at every step of every request,
    and both decode as plain decoding."""
    path = mtp_model()
    prompts = [random_prompt(21, 0), random_prompt(35, 1), random_prompt(9, 2)]
    plain = run_to_idle(make_engine(path, **on_device('cuda')), prompts, greedy(14))
    runs = {}
    for switch in ('0', '1'):
        monkeypatch.setenv('LMDEPLOY_SPEC_CHAIN_GRAPH', switch)
        engine = make_engine(path, speculative_config=mtp_spec(), **on_device('cuda'))
        engine.speculative.set_draft_override(drafts := DraftRecorder())
        runs[switch] = (run_to_idle(engine, prompts, greedy(14)), drafts.proposals, engine.agent.chain_graphs)
    (off, off_drafts, off_graphs), (on, on_drafts, on_graphs) = runs['0'], runs['1']
    assert off_graphs is None and on_graphs.num_replays > 0
    assert on == off == plain
    assert on_drafts == off_drafts


@pytest.mark.gpu
def test_graph_replay_is_exact_on_unaligned_prefix_cache_hits(mtp_model):
    def engine_of(path, **kw):
        return make_engine(path, **on_device('cuda'), **kw)
    _unaligned_hits(engine_of, mtp_model())


@pytest.mark.gpu
def test_aborts_mid_verify_with_graphs_leak_nothing(mtp_model):
    engine = make_engine(mtp_model(), cache=True, speculative_config=mtp_spec(), **on_device('cuda'))
    _aborts_mid_verify_leak_nothing(engine)
    assert engine.agent.verify_graphs.num_replays > 0
