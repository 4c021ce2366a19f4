"""Prefix caching with LoRA adapters: a KV block or state checkpoint made under one adapter never serves another.

Each adapter identity (name + digest) has its own trie root and its own checkpoints; the same prompt under
adapters a, b and the base model gives three chains, a follow-up under each hits only its own chain, warm equals
cold (a cache-off engine with the same adapters), and the block / slot accounting holds after every step.
Adapters are random (deltas far above the tolerance), so a hit that crossed adapters would fail warm == cold.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import pytest
import torch
from engines import engine_factory
from lora_folders import write_model_adapter
from numeric import assert_close

from lmdeploy.pytorch.engine.engine import Engine
from lmdeploy.pytorch.messages import SamplingParams

B = 16
ATOL = 1e-4
TARGETS = {'qwen3': ['q_proj', 'v_proj', 'down_proj'],
           'qwen3_5': ['in_proj_qkv', 'in_proj_b', 'in_proj_a', 'q_proj', 'gate_proj']}
NO_POLICIES = dict(prefix_cache_reply_checkpoints=False, prefix_cache_prompt_logits=False,
                   prefix_cache_branch_checkpoints=False)


@pytest.fixture(scope='module')
def setup(tiny_model_factory, tmp_path_factory):
    built = {}

    def get(arch: str) -> tuple[str, dict[str, str]]:
        if arch not in built:
            path = str(tiny_model_factory(arch))
            adapters = {name: write_model_adapter(tmp_path_factory.mktemp(f'{arch}-{name}'), path, TARGETS[arch],
                                                  rank=3 + i, seed=i + 1) for i, name in enumerate('ab')}
            built[arch] = path, adapters
        return built[arch]
    return get


# every engine here caches prefixes with the policies off (a call turns them on, or `cache=False` for a cold one)
make_engine = engine_factory(block_size=B, kernel_block_size=8, num_gpu_blocks=96, max_batch_size=8,
                             max_prefill_token_num=512, enable_prefix_caching=True, **NO_POLICIES)


@dataclass
class Run:
    prompt: list[int]
    adapter: str | None
    cached: int = 0
    generated: list[int] = field(default_factory=list)
    logits: torch.Tensor | None = None


def one(engine: Engine, prompt: list[int], adapter: str | None, max_new_tokens: int = 2) -> Run:
    run = Run(list(prompt), adapter)

    def on_output(out):
        run.cached = out.num_cached
        run.generated += out.new_token_ids
    seq_id = engine.add_request(prompt, SamplingParams(max_new_tokens=max_new_tokens), callback=on_output,
                                collect_logits=True, adapter_name=adapter)
    while engine.has_work:
        engine.step()
        engine.check_integrity()
    run.logits = engine.pop_collected_logits(seq_id)
    return run


def ids(length: int, seed: int) -> list[int]:
    return torch.randint(0, 1000, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def blocks_per_root(engine: Engine) -> Counter:
    """Adapter identity -> trie nodes under its root (every node of a chain keeps its root's identity)."""
    counts = Counter()
    for identity, root in engine.scheduler.trie.kv.roots.items():
        stack = list(root.children.values())
        while stack:
            node = stack.pop()
            assert node.adapter_name == identity
            counts[identity] += 1
            stack.extend(node.children.values())
    return counts


def assert_warm_equals_cold(cold_engine: Engine, warm: Run) -> None:
    cold = one(cold_engine, warm.prompt, warm.adapter, max_new_tokens=len(warm.generated))
    assert cold.cached == 0 and warm.generated == cold.generated
    assert_close(warm.logits, cold.logits[warm.cached:], atol=ATOL, rtol=0, what=f'warm under {warm.adapter}')


@pytest.mark.parametrize('arch', ['qwen3_5', 'qwen3'])
def test_same_prompt_under_two_adapters_and_base_gives_three_chains(setup, arch):
    path, adapters = setup(arch)
    engine = make_engine(path, adapters=adapters)
    identity = {None: None, **{name: a.identity for name, a in engine.adapters.items()}}
    prompt = ids(37, seed=1)  # 2 full blocks + 5 tokens
    for adapter in ('a', 'b', None):
        assert one(engine, prompt, adapter).cached == 0  # the earlier chains are another adapter's
    trie = engine.scheduler.trie
    assert set(trie.kv.roots) == set(identity.values())
    assert blocks_per_root(engine) == {identity[a]: 2 for a in identity}  # two full blocks per chain
    if engine.model_config.is_hybrid:
        live = sorted((ck.adapter_name or '', ck.step) for ck in trie.checkpoints.live())
        assert live == sorted((identity[a] or '', 37) for a in identity)
    # the second and third requests had every token the trie holds cached under another adapter: all 37 on a
    # hybrid (two blocks + the checkpoint's tail), the two full blocks on a dense model
    other = 37 if engine.model_config.is_hybrid else 32
    assert engine.stats['miss_reasons'] == {'novel': 3 * 37 - 2 * other, 'adapter': 2 * other}

    cold = make_engine(path, cache=False, adapters=adapters)
    expected_hit = 37 if engine.model_config.is_hybrid else 32
    for adapter in ('b', None, 'a'):
        warm = one(engine, prompt + ids(6, seed=2), adapter)
        assert warm.cached == expected_hit
        assert_warm_equals_cold(cold, warm)


@pytest.mark.parametrize('arch', ['qwen3_5', 'qwen3'])
@pytest.mark.parametrize('prefix_len', [2 * B, 2 * B + 7], ids=['aligned', 'unaligned'])
def test_a_hit_never_crosses_adapters(setup, arch, prefix_len):
    path, adapters = setup(arch)
    engine = make_engine(path, adapters=adapters)
    cold = make_engine(path, cache=False, adapters=adapters)
    prefix = ids(prefix_len, seed=3)
    first = one(engine, prefix, 'a')
    for adapter in ('b', None):
        run = one(engine, prefix + ids(5, seed=4), adapter)
        assert run.cached == 0, f'{adapter} hit a chain of adapter a'
        assert_warm_equals_cold(cold, run)
        # the adapters differ far beyond the tolerance, so a crossed hit could not pass warm == cold
        assert (run.logits[:prefix_len] - first.logits[:prefix_len]).abs().max() > 100 * ATOL
    run = one(engine, prefix + ids(5, seed=5), 'a')
    assert run.cached == (prefix_len if engine.model_config.is_hybrid else prefix_len // B * B)
    assert_warm_equals_cold(cold, run)


def test_same_name_with_other_weights_is_another_identity(setup, tmp_path):
    path, adapters = setup('qwen3_5')
    other = write_model_adapter(tmp_path / 'other', path, TARGETS['qwen3_5'], rank=3, seed=9)
    first = make_engine(path, adapters=adapters)
    second = make_engine(path, adapters={'a': other, 'b': adapters['b']})
    assert first.adapters['a'].identity != second.adapters['a'].identity
    assert first.adapters['b'].identity == second.adapters['b'].identity


def test_shipped_policies_keep_adapters_apart(setup):
    # prompt-end logits, reply and branch checkpoints on: an identical prompt is a full hit under its own adapter
    # only, and a follow-up resending prompt + reply reuses the reply checkpoint of its own adapter only
    path, adapters = setup('qwen3_5')
    shipped = {policy: True for policy in NO_POLICIES}
    engine = make_engine(path, adapters=adapters, max_prefill_token_num=8192, **shipped)
    cold = make_engine(path, cache=False, adapters=adapters)
    prompt = ids(29, seed=7)
    first = one(engine, prompt, 'a', max_new_tokens=4)
    other = one(engine, prompt, 'b', max_new_tokens=4)
    again = one(engine, prompt, 'a', max_new_tokens=4)
    assert (first.cached, other.cached, again.cached) == (0, 0, 29)  # the kept logits serve a's prompt whole
    assert again.generated == first.generated and other.generated != first.generated
    assert_warm_equals_cold(cold, other)
    follow = prompt + first.generated + ids(3, seed=8)
    # a resumes from its reply checkpoint (prompt + reply minus its last token); b, whose reply differed, from its
    # own prompt-end checkpoint, not from a's deeper one
    for adapter, expected in (('b', 29), ('a', 29 + 3)):
        run = one(engine, follow, adapter)
        assert run.cached == expected
        assert_warm_equals_cold(cold, run)
