"""Seeded synthetic request traces for the prefix-cache benchmark.

A workload is a list of `Conversation`s. The runner drives each conversation as a chain: turn k+1 is sent only
after turn k has finished, and (when `keep_history`) its prompt is the whole history, the assistant's actual
reply to turn k included, plus the new user message, so turn boundaries fall wherever the reply happens to end.
Different conversations interleave. Prompts are rendered with the model's chat template by the runner; this
module only produces message text, from random words of a small built-in vocabulary.

Shapes (for `num_requests` = N):
- multi_turn: ceil(N / 4) conversations of up to 4 turns, all sharing one system prompt.
- shared_doc: one long document (shorter than one prefill chunk) followed by N different questions.
- long_context: ceil(N / 3) conversations of 3 turns; the first prompt holds a document longer than
  `max_prefill_token_num` (so its prefill is chunked), the next two are follow-up questions.
- repeat: ceil(N / 2) distinct prompts, each sent a second time after the first has finished.
- branching: a shared preamble, then sqrt(N) branch sections, then a distinct question per request.
- shared_system: ceil(N / 2) independent conversations of 2 turns, all opening with one long system prompt (about
  half a prefill chunk), interleaved by the runner's rounds: the prefix every request shares is short-stepped next
  to each conversation's own prompt-end and reply checkpoints, the case eviction must not get wrong.

Multimodal shapes (vision-language models; not part of 'all'): an image is a seed, drawn by the runner
(`bench/images.py`), and sits before the text of a conversation's first turn.
- mm_shared_images: the same two images followed by N different questions (the prefix cache should resume right
  after the images: the last image's end is checkpointed).
- mm_multi_turn: ceil(N / 3) conversations of 3 turns over one image each.
"""
from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass

WORKLOADS = ('multi_turn', 'shared_doc', 'long_context', 'repeat', 'branching', 'shared_system')
MULTIMODAL_WORKLOADS = ('mm_shared_images', 'mm_multi_turn')

_VOCABULARY = tuple("""
the a of and to in is was for on with as by at from that this it he she they we you his her their our
time year day week morning evening night spring summer autumn winter weather rain snow wind cloud sun moon star
river lake sea ocean mountain valley forest garden park village town city country road bridge station train bus
house door window room table chair shop market school library museum gallery clock watch gear key book page
old new small large tall short warm cold bright dark quiet busy simple careful gentle quick slow lazy brown
red yellow purple white green blue orange black golden silver
walk run open close wait watch read write cook travel visit build fix learn teach carry follow begin finish
bread soup onion garlic tomato pepper salt oil water tea coffee apple cherry flower tree leaf bee bird fox dog
child parent friend teacher doctor farmer baker clockmaker traveller athlete team player visitor neighbour
story journey question answer idea plan reason example detail number price item list tag name version
""".split())

Messages = list[dict[str, str]]
CountTokens = Callable[[str], int]


@dataclass(frozen=True)
class Conversation:
    """A chain of user turns; the runner sends turn k+1 after turn k finishes."""
    conv_id: int
    system: str | None
    user_turns: tuple[str, ...]
    # True: each prompt is the whole history (assistant replies included); False: system + this turn only.
    keep_history: bool = True
    # Seeds of the images placed before the text of the first turn (the runner draws them).
    images: tuple[int, ...] = ()


@dataclass(frozen=True)
class Workload:
    name: str
    conversations: tuple[Conversation, ...]

    @property
    def num_requests(self) -> int:
        return sum(len(c.user_turns) for c in self.conversations)


@dataclass(frozen=True)
class WorkloadSizing:
    """Token geometry the generators aim at (counted with the model's tokenizer)."""
    max_prefill_token_num: int
    # Upper bound for one prompt including the history of its conversation.
    max_prompt_tokens: int


def _words(rng: random.Random, n: int) -> str:
    return ' '.join(rng.choice(_VOCABULARY) for _ in range(n))


def _sentences(rng: random.Random, num_words: int) -> str:
    out, left = [], num_words
    while left > 0:
        n = min(left, rng.randint(6, 14))
        sentence = _words(rng, n)
        out.append(sentence[0].upper() + sentence[1:] + '.')
        left -= n
    return ' '.join(out)


def _text_of_tokens(rng: random.Random, target_tokens: int, count_tokens: CountTokens) -> str:
    """Sentences whose token count just reaches `target_tokens` (grown in steps, measured with the tokenizer)."""
    text = ''
    while count_tokens(text) < target_tokens:
        text = (text + ' ' + _sentences(rng, 24)).strip()
    return text


def _question(rng: random.Random) -> str:
    return f'Question: what does the text say about the {_words(rng, rng.randint(2, 6))}?'


def _multi_turn(rng: random.Random, n: int, sizing: WorkloadSizing, count_tokens: CountTokens) -> list[Conversation]:
    system = 'You are a helpful assistant. ' + _sentences(rng, 40)
    convs, left = [], n
    for conv_id in range(math.ceil(n / 4)):
        turns = tuple(_sentences(rng, rng.randint(8, 30)) for _ in range(min(4, left)))
        left -= len(turns)
        convs.append(Conversation(conv_id, system, turns))
    return convs


def _shared_doc(rng: random.Random, n: int, sizing: WorkloadSizing, count_tokens: CountTokens) -> list[Conversation]:
    doc = _text_of_tokens(rng, min(sizing.max_prefill_token_num * 3 // 4, sizing.max_prompt_tokens // 2),
                          count_tokens)
    return [Conversation(i, None, (f'Document:\n{doc}\n\n{_question(rng)}',)) for i in range(n)]


def _long_context(rng: random.Random, n: int, sizing: WorkloadSizing,
                  count_tokens: CountTokens) -> list[Conversation]:
    # 2.5 chunks, but leave room for the follow-up turns (questions + replies) in the session.
    target = min(sizing.max_prefill_token_num * 5 // 2, sizing.max_prompt_tokens * 3 // 4)
    convs, left = [], n
    for conv_id in range(math.ceil(n / 3)):
        doc = _text_of_tokens(rng, target, count_tokens)
        turns = (f'Document:\n{doc}\n\n{_question(rng)}',) + tuple(_question(rng) for _ in range(2))
        turns = turns[:min(3, left)]
        left -= len(turns)
        convs.append(Conversation(conv_id, None, turns))
    return convs


def _repeat(rng: random.Random, n: int, sizing: WorkloadSizing, count_tokens: CountTokens) -> list[Conversation]:
    convs, left = [], n
    for conv_id in range(math.ceil(n / 2)):
        prompt = _sentences(rng, rng.randint(30, 80))
        turns = (prompt, prompt)[:min(2, left)]
        left -= len(turns)
        convs.append(Conversation(conv_id, None, turns, keep_history=False))
    return convs


def _branching(rng: random.Random, n: int, sizing: WorkloadSizing, count_tokens: CountTokens) -> list[Conversation]:
    preamble = _sentences(rng, 60)
    branches = [_sentences(rng, rng.randint(20, 40)) for _ in range(max(2, round(math.sqrt(n))))]
    # Round-robin over branches so that every branch is revisited by later requests.
    return [Conversation(i, None, (f'{preamble}\n\n{branches[i % len(branches)]}\n\n{_question(rng)}',))
            for i in range(n)]


def _shared_system(rng: random.Random, n: int, sizing: WorkloadSizing,
                   count_tokens: CountTokens) -> list[Conversation]:
    system = 'You are a careful assistant. ' + _text_of_tokens(
        rng, min(sizing.max_prefill_token_num // 2, sizing.max_prompt_tokens // 3), count_tokens)
    convs, left = [], n
    for conv_id in range(math.ceil(n / 2)):
        turns = tuple(_sentences(rng, rng.randint(6, 20)) for _ in range(min(2, left)))
        left -= len(turns)
        convs.append(Conversation(conv_id, system, turns))
    return convs


def _mm_shared_images(rng: random.Random, n: int, sizing: WorkloadSizing,
                      count_tokens: CountTokens) -> list[Conversation]:
    seeds = (rng.randrange(1 << 30), rng.randrange(1 << 30))
    return [Conversation(i, None, (_question(rng),), images=seeds) for i in range(n)]


def _mm_multi_turn(rng: random.Random, n: int, sizing: WorkloadSizing,
                   count_tokens: CountTokens) -> list[Conversation]:
    convs, left = [], n
    for conv_id in range(math.ceil(n / 3)):
        turns = tuple(_question(rng) for _ in range(min(3, left)))
        left -= len(turns)
        convs.append(Conversation(conv_id, None, turns, images=(rng.randrange(1 << 30),)))
    return convs


_GENERATORS: dict[str, Callable[[random.Random, int, WorkloadSizing, CountTokens], list[Conversation]]] = {
    'multi_turn': _multi_turn,
    'shared_doc': _shared_doc,
    'long_context': _long_context,
    'repeat': _repeat,
    'branching': _branching,
    'shared_system': _shared_system,
    'mm_shared_images': _mm_shared_images,
    'mm_multi_turn': _mm_multi_turn,
}


def build_workload(name: str, num_requests: int, seed: int, sizing: WorkloadSizing,
                   count_tokens: CountTokens) -> Workload:
    """The trace of workload `name` with exactly `num_requests` requests, fully determined by `seed`."""
    if name not in WORKLOADS + MULTIMODAL_WORKLOADS:
        raise ValueError(f'unknown workload {name!r}; expected one of {WORKLOADS + MULTIMODAL_WORKLOADS}')
    if num_requests <= 0:
        raise ValueError(f'num_requests must be positive, got {num_requests}')
    rng = random.Random(f'{name}:{seed}')
    convs = _GENERATORS[name](rng, num_requests, sizing, count_tokens)
    return Workload(name, tuple(convs))


def conversation_messages(conv: Conversation, turn: int, replies: list[str]) -> Messages:
    """Chat messages of request `turn` of `conv`; `replies[k]` is the assistant's reply to turn k. With images, the
    first turn's content is a list of parts: `{'type': 'image', 'image': seed}` per image, then the text."""
    messages: Messages = [{'role': 'system', 'content': conv.system}] if conv.system else []

    def user(k: int):
        if k or not conv.images:
            return conv.user_turns[k]
        return [{'type': 'image', 'image': seed} for seed in conv.images] + [
            {'type': 'text', 'text': conv.user_turns[k]}]
    if conv.keep_history:
        for k in range(turn):
            messages += [{'role': 'user', 'content': user(k)}, {'role': 'assistant', 'content': replies[k]}]
    messages.append({'role': 'user', 'content': user(turn)})
    return messages
