"""OpenAI sampling options in the sampler (`backends/default/sampling.py`), against transformers' logits
processors (min-p, sequence bias) and OpenAI's documented penalty formula, through `make_sampling_inputs`."""
from __future__ import annotations

import torch
import transformers as tf

from lmdeploy.pytorch.backends.default.sampling import sample
from lmdeploy.pytorch.engine.inputs_maker import make_sampling_inputs
from lmdeploy.pytorch.messages import SamplingParams, SchedulerSequence

VOCAB = 64


def _seq(seq_id: int, prompt: list[int], generated: list[int], **params) -> SchedulerSequence:
    return SchedulerSequence(seq_id=seq_id, token_ids=prompt + generated, num_prompt_tokens=len(prompt),
                             sampling=SamplingParams(**params))


def _sample(seqs, logits, generators=None):
    inputs, rejected = make_sampling_inputs(seqs, generators or {})
    assert not rejected
    return sample(logits.clone(), inputs)[0]


def test_presence_and_frequency_penalties_follow_openais_formula():
    torch.manual_seed(0)
    for trial in range(40):
        logits = torch.randn(1, VOCAB) * 2
        generated = torch.randint(0, 8, (12,)).tolist()  # repeated ids among the first 8
        presence, frequency = (trial % 5 - 2) * 0.9, (trial % 3 - 1) * 0.7
        seq = _seq(trial, [60, 61, 62, 0, 1], generated, presence_penalty=presence, frequency_penalty=frequency)
        # OpenAI: mu[j] -= c[j] * frequency + (c[j] > 0) * presence, c counting generated tokens only
        counts = torch.bincount(torch.tensor(generated), minlength=VOCAB).float()
        reference = logits[0] - counts * frequency - (counts > 0).float() * presence
        assert _sample([seq], logits).item() == reference.argmax().item()


def test_penalties_leave_other_rows_alone():
    torch.manual_seed(3)
    logits = torch.randn(2, VOCAB)  # gaps far below the penalty of 3 x 2.0
    plain = _seq(1, [3], [5, 5, 5])
    penalised = _seq(2, [3], [int(logits[1].argmax())] * 3, frequency_penalty=2.0)
    out = _sample([plain, penalised], logits)
    assert out[0].item() == logits[0].argmax().item()
    assert out[1].item() != logits[1].argmax().item()


def test_logit_bias_matches_transformers_sequence_bias():
    torch.manual_seed(1)
    for trial in range(20):
        logits = torch.randn(1, VOCAB) * 3
        bias = {int(t): float(b) for t, b in zip(torch.randint(0, VOCAB, (4,)), torch.randn(4) * 5)}
        seq = _seq(trial, [1, 2], [], logit_bias=tuple(sorted(bias.items())))
        processor = tf.SequenceBiasLogitsProcessor([[[t], b] for t, b in bias.items()])
        reference = processor(torch.tensor([[1, 2]]), logits.clone())
        assert _sample([seq], logits).item() == reference.argmax().item()


def test_min_p_keeps_exactly_transformers_min_p_set():
    torch.manual_seed(2)
    logits = torch.randn(1, VOCAB)
    temperature, min_p = 0.8, 0.25
    warped = tf.MinPLogitsWarper(min_p)(torch.tensor([[0]]), logits / temperature)
    allowed = set(torch.nonzero(torch.isfinite(warped[0])).flatten().tolist())
    assert 1 < len(allowed) < VOCAB // 2
    seq = _seq(1, [0], [], temperature=temperature, min_p=min_p, random_seed=7)
    gen = torch.Generator().manual_seed(7)
    drawn = {_sample([seq], logits, {1: gen}).item() for _ in range(600)}
    assert drawn == allowed


def test_rows_without_options_build_no_option_tensors():
    inputs, _ = make_sampling_inputs([_seq(1, [1], [2, 3]), _seq(2, [1], [])], {})
    assert inputs.output_ids is None and inputs.min_p is None and inputs.logit_bias is None
    assert inputs.presence_penalty is None and inputs.frequency_penalty is None
