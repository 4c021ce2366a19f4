"""Draft verification: greedy acceptance emits exactly plain greedy's tokens; rejection sampling's emitted stream is
distributed as the target's own (a Markov-chain target and draft, checked against the exact chain probabilities)."""
from __future__ import annotations

import itertools

import torch

from lmdeploy.pytorch.engine.spec_acceptance import greedy_accept, rejection_sample


def test_greedy_accepts_the_matching_prefix_and_emits_target_argmax():
    torch.manual_seed(0)
    batch, k, vocab = 64, 3, 11
    logits = torch.randn(batch, k + 1, vocab)
    target = logits.argmax(-1)
    drafts = target[:, :k].clone()
    want = torch.randint(0, k + 1, (batch,))
    for b in range(batch):  # corrupt draft want[b] (0-based) so exactly want[b] drafts match
        if want[b] < k:
            drafts[b, want[b]] = (drafts[b, want[b]] + 1) % vocab
    got = greedy_accept(drafts, logits)
    assert torch.equal(got.num_accepted, want)
    for b in range(batch):
        n = int(want[b])
        # the emitted tokens are greedy's: the matched drafts, then the target's own choice where they diverged
        assert torch.equal(got.tokens[b, :n + 1], target[b, :n + 1])
        assert torch.equal(got.tokens[b, :n], drafts[b, :n])


def _chain(vocab: int, seed: int, sharp: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(vocab, vocab, generator=g) * sharp).softmax(-1)


def test_rejection_sampling_stream_is_distributed_as_the_target():
    vocab, k, chains, length = 3, 2, 30000, 3
    target, draft = _chain(vocab, 1, 1.5), _chain(vocab, 2, 1.5)  # P(next | prev), Q(next | prev)
    g = torch.Generator().manual_seed(3)
    last = torch.zeros(chains, dtype=torch.int64)
    streams = [[] for _ in range(chains)]
    live = torch.arange(chains)
    while len(live):
        prev, drafts, dprobs, tprobs = last[live], [], [], []
        for _ in range(k):
            q = draft[prev]
            d = torch.multinomial(q, 1, generator=g)[:, 0]
            dprobs.append(q)
            tprobs.append(target[prev])
            drafts.append(d)
            prev = d
        tprobs.append(target[prev])
        out = rejection_sample(torch.stack(drafts, 1), torch.stack(dprobs, 1), torch.stack(tprobs, 1), g)
        for row, chain in enumerate(live.tolist()):
            emitted = out.tokens[row, :int(out.num_accepted[row]) + 1].tolist()
            streams[chain].extend(emitted)
            last[chain] = emitted[-1]
        live = torch.tensor([c for c in live.tolist() if len(streams[c]) < length], dtype=torch.int64)
    counts = {}
    for s in streams:
        key = tuple(s[:length])
        counts[key] = counts.get(key, 0) + 1
    for key in itertools.product(range(vocab), repeat=length):
        prob, prev = 1.0, 0
        for token in key:
            prob *= float(target[prev, token])
            prev = token
        got = counts.get(key, 0) / chains
        sigma = (prob * (1 - prob) / chains) ** 0.5
        assert abs(got - prob) < 5 * sigma + 1e-4, (key, got, prob)


def test_rejection_with_identical_draft_accepts_everything():
    vocab, k, batch = 7, 4, 256
    probs = torch.randn(batch, k + 1, vocab).softmax(-1)
    drafts = torch.multinomial(probs[:, :k].reshape(-1, vocab), 1).view(batch, k)
    out = rejection_sample(drafts, probs[:, :k], probs, torch.Generator().manual_seed(0))
    assert torch.equal(out.num_accepted, torch.full((batch,), k))
    assert torch.equal(out.tokens[:, :k], drafts)
