"""MTP speculative decoding through the engine, against plain decoding of the same engine as the reference (itself
tested against transformers elsewhere), on tiny random Qwen3.5 / Qwen3-Next checkpoints with random `mtp.*` weights.

- Greedy speculative decoding emits exactly plain greedy's tokens, and the target logits of every committed
  position match plain decoding's within tolerance: single and concurrent requests, chunked prefill, prefix cache
  on with hits at aligned and unaligned checkpoints.
- Forced acceptance: a draft override replays plain greedy's continuation, wrong at a chosen position, so every
  acceptance count 0 .. K happens; after each step the runtime recurrent state equals plain decoding's at the same
  step.
- After a prefix-cache hit the draft head proposes exactly what it proposes on a cold run (the position before the
  hit is recomputed from the checkpoint's hidden state into a private block).
- The integrity check holds after every step, also when a forward fails mid-verify and when requests are aborted
  while their drafts are in flight.
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
    drafts_wrong_at,
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

from lmdeploy.pytorch.engine.spec_decode import PendingDrafts
from lmdeploy.pytorch.messages import SamplingParams

pytest.importorskip('transformers')


DEVICES = ['cpu', pytest.param('cuda', marks=pytest.mark.gpu)]


@pytest.mark.parametrize('device', DEVICES)
@pytest.mark.parametrize('name', ['qwen3_5', 'qwen3_next'])
def test_greedy_speculative_matches_plain_decoding(mtp_model, name, device):
    path = mtp_model(name)
    prompts = [random_prompt(21, 0), random_prompt(35, 1), random_prompt(9, 2)]  # concurrent, uneven lengths
    plain, plain_logits = run_to_idle(make_engine(path, **on_device(device)), prompts, greedy(14), collect=True)
    engine = make_engine(path, speculative_config=mtp_spec(), **on_device(device))
    spec, spec_logits = run_to_idle(engine, prompts, greedy(14), collect=True)
    assert spec == plain
    for got, want in zip(spec_logits, plain_logits):
        assert got.shape == want.shape
        tol = ATOL if device == 'cpu' else 10 * ATOL  # CUDA: a K + 1 token verify runs other kernels than decode
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    stats = engine.stats
    assert stats['spec_verify_rows'] > 0 and stats['spec_draft_tokens'] == K * stats['spec_verify_rows']


def test_chunked_prefill_speculative_matches_plain(mtp_model):
    path = mtp_model()
    prompts = [random_prompt(50, 3), random_prompt(41, 4)]
    plain = run_to_idle(make_engine(path, max_prefill_token_num=16), prompts, greedy(10))
    spec = run_to_idle(make_engine(path, max_prefill_token_num=16, speculative_config=mtp_spec()), prompts, greedy(10))
    assert spec == plain


def test_stop_token_inside_an_accepted_run_ends_like_plain_decoding(mtp_model):
    """Forced full acceptance: a stop id or a stop sequence deep inside an accepted run ends the request exactly where
    plain decoding ends it (same tokens, nothing after the stop)."""
    path = mtp_model()
    prompt = random_prompt(19, 5)
    (cont,) = run_to_idle(make_engine(path), [prompt], greedy(16))
    full = prompt + cont
    for sampling in (SamplingParams(max_new_tokens=16, temperature=0.0, stop_token_ids=[cont[6]]),
                     SamplingParams(max_new_tokens=16, temperature=0.0, stop_sequences=(tuple(cont[4:6]),)),
                     SamplingParams(max_new_tokens=5, temperature=0.0)):
        plain = run_to_idle(make_engine(path), [prompt], sampling)
        engine = make_engine(path, speculative_config=mtp_spec())
        engine.speculative.set_draft_override(lambda seq, _: (full + [0] * K)[seq.num_tokens:seq.num_tokens + K])
        assert run_to_idle(engine, [prompt], sampling) == plain


def test_forced_acceptance_every_count_leaves_the_plain_decode_state(mtp_model):
    checked, _ = forced_acceptance_states(mtp_model())
    assert checked >= 8


def _trie_blocks(engine) -> dict[int, torch.Tensor]:
    """Trie-owned KV blocks -> their bytes in every KV-pool layer (the MTP head's included), read once the device
    has run everything queued: block copies (checkpoint saves) run on the forward stream, and a step's tokens can
    reach the host before the save after its forward is done (a snapshot read on the default stream before the
    reply checkpoint's save had landed looked like a rewrite one step later: the H200 failure of 2026-12-01 that
    came and went with timing, e.g. never under eager mode)."""
    blocks = sorted(engine.scheduler.prefix_cache.owners()[0])
    pool, per = engine.cache_engine.kv_pool, engine.cache_config.pages_per_block
    if pool.is_cuda:
        torch.cuda.synchronize(pool.device)
    offsets = engine.scheduler.block_manager.resolve_gpu_block_offsets(blocks)
    return {b: pool[:, int(o) * per:(int(o) + 1) * per].clone() for b, o in zip(blocks, offsets)}


@pytest.mark.parametrize('device', DEVICES)
@pytest.mark.parametrize('prompt_len', [32, 37], ids=['aligned', 'unaligned'])
def test_prefix_cache_hits_are_lossless_and_drafts_match_a_cold_run(mtp_model, prompt_len, device):
    """Request 1 leaves a prompt-end checkpoint at step `prompt_len` (block-aligned or not) and a reply checkpoint;
    request 2 extends request 1's prompt and resumes at its checkpoint. Tokens equal plain decoding without a cache,
    and the head's drafts after the hit equal those of a cold speculative run of request 2."""
    path = mtp_model()
    first = random_prompt(prompt_len, 7)
    second = first + random_prompt(6, 8)
    plain, plain_logits = zip(*[run_to_idle(make_engine(path, **on_device(device)), [p], greedy(10), collect=True)
                                for p in (first, second)])
    plain = [tokens for (tokens,) in plain]
    tol = ATOL if device == 'cpu' else 10 * ATOL
    cold = DraftRecorder()
    engine = make_engine(path, speculative_config=mtp_spec(), **on_device(device))
    engine.speculative.set_draft_override(cold)
    assert run_to_idle(engine, [second], greedy(10)) == [plain[1]]
    warm = DraftRecorder()
    engine = make_engine(path, cache=True, speculative_config=mtp_spec(), **on_device(device))
    assert run_to_idle(engine, [first], greedy(10)) == [plain[0]]
    engine.speculative.set_draft_override(warm)
    hits, cached = [], _trie_blocks(engine)

    def after_step(e):
        record_hits(hits)(e)
        now = _trie_blocks(e)
        for block, data in cached.items():  # no forward writes a block the trie owns (the head's overlap row too)
            if block in now:
                assert torch.equal(now[block], data), f'trie block {block} was rewritten'
    out, (logits,) = run_to_idle(engine, [second], greedy(10), collect=True, after_step=after_step)
    assert out == [plain[1]]
    assert hits and hits[0] == prompt_len  # resumed at request 1's prompt-end checkpoint
    torch.testing.assert_close(logits, plain_logits[1][0][prompt_len:], atol=tol, rtol=tol)
    assert warm.proposals == cold.proposals
    # a third request resumes from request 1's reply checkpoint (unaligned): still exact
    check_resume_at_reply_checkpoint(engine, make_engine(path, **on_device(device)), first, plain[0], tol)


def test_concurrent_requests_with_prefix_cache_and_chunks(mtp_model):
    path = mtp_model()
    shared = random_prompt(40, 10)
    prompts = [shared + random_prompt(5 + i, 11 + i) for i in range(4)]
    plain = run_to_idle(make_engine(path), prompts, greedy(12))
    engine = make_engine(path, cache=True, max_prefill_token_num=32, speculative_config=mtp_spec(2))
    assert run_to_idle(engine, prompts, greedy(12)) == plain
    assert run_to_idle(engine, prompts, greedy(12)) == plain  # the second round hits the cache
    assert engine.stats['hit_tokens'] > 0


def test_failed_verify_forward_and_aborts_leak_nothing(mtp_model):
    path = mtp_model()
    engine = make_engine(path, cache=True, speculative_config=mtp_spec())
    free = num_free(engine)
    ids = [engine.add_request(random_prompt(20, 12 + i), greedy(30)) for i in range(3)]
    for _ in range(3):
        engine.step()
        engine.check_integrity()
    seqs = [engine._seqs[i][0] for i in ids]
    assert all(seq.draft_ids and len(seq.draft_slots) == K for seq in seqs)
    spec = engine.agent.spec
    original = spec.draft

    def failing(*args, **kwargs):
        raise RuntimeError('injected head failure')
    spec.draft = failing  # the verify forward runs, then the head fails mid-step
    outputs = engine.step()
    spec.draft = original
    assert {o.seq_id for o in outputs if o.error} == set(ids)
    engine.check_integrity()
    # aborts while drafts are pending
    ids = [engine.add_request(random_prompt(20, 20 + i), greedy(30)) for i in range(3)]
    for _ in range(3):
        engine.step()
    for i in ids:
        engine.abort_request(i)
    engine.run_until_idle()
    engine.check_integrity()
    assert_pools_returned(engine, free)


def test_drafts_are_read_after_the_bookkeeping_and_a_failed_read_only_costs_the_drafts(mtp_model, monkeypatch):
    """The engine reads a step's drafts after delivering and committing it (`PendingDrafts`); when that read fails
    the sequences decode their next step without drafts, and the tokens stay plain decoding's."""
    path = mtp_model()
    prompts = [random_prompt(20, 30), random_prompt(13, 31)]
    want = run_to_idle(make_engine(path), prompts, greedy(12))
    engine = make_engine(path, speculative_config=mtp_spec())
    order, failures = [], iter([False, False, True])
    resolve = PendingDrafts.resolve

    def logged(self):
        order.append('drafts')
        if next(failures, False):
            raise RuntimeError('injected draft read failure')
        return resolve(self)
    monkeypatch.setattr(PendingDrafts, 'resolve', logged)
    deliver = engine._deliver_all
    engine._deliver_all = lambda outs: (order.append('deliver') if outs else None, deliver(outs))[1]
    drafted = []
    got = run_to_idle(engine, prompts, greedy(12),
               after_step=lambda e: drafted.append([bool(s.draft_ids) for s, _ in e._seqs.values()]))
    assert got == want
    assert order[:2] == ['deliver', 'drafts']
    assert drafted[2] == [False, False] and all(drafted[3]) and all(drafted[1])


@pytest.mark.parametrize('drafts', ['forced', 'head'])
def test_rejection_sampling_through_the_engine_samples_the_target_distribution(mtp_model, drafts):
    """Sampled requests (temperature 1, top-k 4): the first verified token t2 given the first token t1 is distributed
    as the target's processed p(t2 | prompt, t1), computed from plain decoding's logits. Drafts come from the head's
    own processed distribution, or are forced to the target's most likely t2 (a point-mass draft), so that both
    acceptance and the residual draw happen often."""
    from lmdeploy.pytorch.engine.spec_decode import SampleParams, processed_probs
    path = mtp_model()
    prompt, top_k, n = random_prompt(12, 30), 4, 480
    params = SampleParams(1.0, top_k, 1.0, 0.0, None)
    plain = make_engine(path)
    _, (logits,) = run_to_idle(plain, [prompt], greedy(1), collect=True)
    first = processed_probs(logits[-1:], params)[0]
    support = first.nonzero()[:, 0].tolist()
    target = {}
    for t1 in support:
        _, (logits,) = run_to_idle(plain, [prompt + [t1]], greedy(1), collect=True)
        target[t1] = processed_probs(logits[-1:], params)[0]
    engine = make_engine(path, max_batch_size=16, speculative_config=mtp_spec(2))
    if drafts == 'forced':
        engine.speculative.set_draft_override(lambda seq, _: [int(target[seq.token_ids[len(prompt)]].argmax())] * 2)
    runs = run_to_idle(engine, [prompt] * n, [SamplingParams(max_new_tokens=3, temperature=1.0, top_k=top_k,
                                                      random_seed=i) for i in range(n)])
    counts = {t1: torch.zeros_like(p) for t1, p in target.items()}
    for run in runs:
        counts[run[0]][run[1]] += 1
    chi2, df = 0.0, 0
    for t1, p in target.items():
        total = counts[t1].sum()
        keep = p > 0
        assert counts[t1][~keep].sum() == 0  # nothing outside the target's support
        expected = p[keep] * total
        chi2 += float(((counts[t1][keep] - expected) ** 2 / expected.clamp_min(1e-9)).sum())
        df += int(keep.sum()) - 1
    stats = engine.stats
    assert stats['spec_accepted_tokens'] < stats['spec_draft_tokens']
    if drafts == 'forced':  # (the random head's top 4 rarely meets the target's: its drafts are mostly rejected)
        assert stats['spec_accepted_tokens'] > 0
    assert chi2 < df + 4 * (2 * df) ** 0.5, (chi2, df)  # about 4 sigma of a chi-square with df degrees


def test_decode_interval_checkpoints_come_from_committed_steps_inside_accepted_runs(mtp_model):
    """Forced full acceptance: the decode-interval steps 16, 32, 48 fall inside accepted runs, so each checkpoint is
    saved from the spare row cut at that draft position. A later request resuming at step 32 is exact."""
    path = mtp_model()
    prompt = random_prompt(10, 40)
    (cont,) = run_to_idle(make_engine(path), [prompt], greedy(44))
    full = prompt + cont + [0] * (2 * K)
    engine = make_engine(path, cache=True, prefix_cache_decode_state_interval=16, speculative_config=mtp_spec())
    engine.speculative.set_draft_override(lambda seq, _: full[seq.num_tokens:seq.num_tokens + K])
    assert run_to_idle(engine, [prompt], greedy(44)) == [cont]
    later = full[:35] + random_prompt(3, 41)
    want, (want_logits,) = run_to_idle(make_engine(path), [later], greedy(8), collect=True)
    engine.speculative.set_draft_override(None)
    hits = []
    got, (got_logits,) = run_to_idle(engine, [later], greedy(8), collect=True, after_step=record_hits(hits))
    assert got == want and hits[0] == 32
    # the warm run feeds from step 32: its logits are the cold run's from there on
    torch.testing.assert_close(got_logits, want_logits[32:], atol=ATOL, rtol=ATOL)


def _with_logprobs(engine, prompts, sampling):
    """Each request's tokens and the logprobs delivered with them (one dict per delivered token)."""
    tokens, logprobs = {}, {}

    def callback(o):
        tokens.setdefault(o.seq_id, []).extend(o.new_token_ids)
        logprobs.setdefault(o.seq_id, []).extend(o.logprobs or [])
    ids = [engine.add_request(p, sampling, callback=callback) for p in prompts]
    while engine.has_work:
        engine.step()
        engine.check_integrity()
    return [tokens.get(i, []) for i in ids], [logprobs.get(i, []) for i in ids]


def test_requests_with_logprobs_speculate_and_get_plain_decodings_logprobs(mtp_model):
    """A request asking for logprobs drafts like any other and gets, for every emitted token (accepted drafts
    included), the top logprobs plain decoding reports for it. Forced acceptance (plain greedy's continuation,
    wrong at a varying draft) makes runs of every length 1 .. K + 1."""
    path = mtp_model()
    prompts = [random_prompt(21, 30), random_prompt(14, 31)]
    sampling = SamplingParams(max_new_tokens=12, temperature=0.0, logprobs=3)
    plain, plain_lp = _with_logprobs(make_engine(path), prompts, sampling)
    full = {tuple(p[:4]): p + t + [0] * (2 * K) for p, t in zip(prompts, plain)}
    engine = make_engine(path, speculative_config=mtp_spec())
    engine.speculative.set_draft_override(drafts_wrong_at(lambda seq: full[tuple(seq.token_ids[:4])],
                                                          iter([3, 0, 2, 1] * 20)))
    spec, spec_lp = _with_logprobs(engine, prompts, sampling)
    assert spec == plain
    assert engine.stats['spec_accepted_tokens'] > 0
    for got_row, want_row, tokens in zip(spec_lp, plain_lp, spec):
        assert len(got_row) == len(want_row) == len(tokens)
        for got, want in zip(got_row, want_row):
            assert got.keys() == want.keys()
            torch.testing.assert_close(torch.tensor(list(got.values())), torch.tensor([want[k] for k in got]),
                                       atol=ATOL, rtol=ATOL)
