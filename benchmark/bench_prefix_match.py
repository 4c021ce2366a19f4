"""CPU cost of prefix matching (`BlockTrie.match`) per request, against live checkpoints and prefix length.

Paging layer only: no model, no device. A trie is populated through the public methods the scheduler uses
(`attach`, `reserve_checkpoint`, `publish_checkpoint`), then `match` is timed for a request that extends the cached
prefix by a few tokens (a hit at the prefix end) and for an unrelated request of the same length (a miss).

Population, for a prefix of L tokens and N live checkpoints (block size 64):
- the prefix itself is attached as a path of L // 64 nodes;
- min(N // 2, 64) checkpoints lie on that path at evenly spaced steps, one of them at L (the earlier turn's end);
- min(rest, 256) "deep" branches fork off the path at random block boundaries with a 1..127-token tail;
- the rest are "shallow" branches forking within the first 1K tokens (requests sharing a system prompt).
Branch checkpoints anchored on a path node are candidates for the query and must be rejected by verification.

Columns: `cands` = candidates the index prefilter returns for the hit query; `hit` = the resume step found;
`match_us` = median wall time of `match` for the hit query, called again on the same request (a request waiting for
admission is matched once per step); `first_us` = the first `match` of a fresh copy of it (prefix hashes computed
then); `index_us` = the vectorised candidate prefilter alone; `miss_us` / `miss_first_us` = the same for an
unrelated query of the same length; `to_array_us` = converting the prompt list to int64, done once per request when
it is submitted (`Engine.add_request`, in the caller's thread), not by `match`; `ck_MB` = memory of the checkpoints'
frozen token arrays (each keeps its token ids [0, step)).

`--dense` runs the same population without checkpoints (a dense model: the trie alone, `hit` block-aligned).

    python benchmark/bench_prefix_match.py            # 100 / 1k / 10k checkpoints x 1K / 16K / 128K tokens
    python benchmark/bench_prefix_match.py --quick    # 100 / 1k checkpoints x 1K / 16K tokens
    python benchmark/bench_prefix_match.py --dense    # dense model (no checkpoints), same grid
"""
from __future__ import annotations

import argparse
import gc
import statistics
import time
from dataclasses import dataclass

import numpy as np

from lmdeploy.pytorch.messages import SamplingParams, SchedulerSequence
from lmdeploy.pytorch.paging.block_manager import BlockManager
from lmdeploy.pytorch.paging.block_trie.block_trie import BlockTrie, PrefixMatch
from lmdeploy.pytorch.paging.state_manager import StateManager

VOCAB = 150_000
MAX_ON_PATH = 64
MAX_DEEP = 256
SHALLOW_TOKENS = 1024


@dataclass
class Setup:
    trie: BlockTrie
    hit_query: SchedulerSequence
    miss_query: SchedulerSequence


class Populator:
    """Builds sequences and checkpoints through the trie's public methods."""

    def __init__(self, prefix_len: int, num_checkpoints: int, block_size: int, seed: int, dense: bool = False):
        self.bs = block_size
        self.rng = np.random.default_rng(seed)
        num_path_blocks = prefix_len // block_size
        num_blocks = num_path_blocks + 2 * num_checkpoints + 16
        self.block_manager = BlockManager(num_blocks)
        self.state_manager = None if dense else StateManager(num_checkpoints + 2)
        self.trie = BlockTrie(self.block_manager, self.state_manager, block_size)
        self._next_id = 0

    def _seq(self, tokens: np.ndarray) -> SchedulerSequence:
        self._next_id += 1
        # Population passes an int64 array as token ids (np.asarray is then free); the timed queries use lists, as
        # the engine does.
        return SchedulerSequence(seq_id=self._next_id, token_ids=tokens, num_prompt_tokens=len(tokens),
                                 sampling=SamplingParams(max_new_tokens=1))

    def _checkpoint(self, seq: SchedulerSequence, step: int) -> None:
        if self.state_manager is None:   # dense: attach the sequence's full blocks only
            self.trie.attach(seq)
            return
        slot = self.state_manager.allocate()
        frozen = self.block_manager.allocate(1)[0] if step % self.bs else None
        ck = self.trie.reserve_checkpoint(seq, step, slot, frozen)
        self.trie.publish_checkpoint(seq, ck)

    def base_path(self, base: np.ndarray, steps: list[int]):
        """Attach the prefix and publish checkpoints at `steps` along it; returns its nodes."""
        seq = self._seq(base)
        seq.block_ids = self.block_manager.allocate(-(-len(base) // self.bs))
        seq.num_computed = len(base)
        nodes = self.trie.attach(seq)
        for step in steps:
            self._checkpoint(seq, step)
        self.trie.on_released(seq)
        self.block_manager.free(seq.block_ids)
        return nodes

    def branch(self, base: np.ndarray, nodes, depth: int, tail_len: int) -> None:
        """A request sharing `depth` blocks of the prefix, then `tail_len` tokens of its own; checkpoint at its end."""
        tail = self.rng.integers(0, VOCAB, tail_len, dtype=np.int64)
        tokens = np.concatenate([base[:depth * self.bs], tail])
        seq = self._seq(tokens)
        own = self.block_manager.allocate(-(-len(tokens) // self.bs) - depth)
        seq.block_ids = [n.block_id for n in nodes[:depth]] + own
        seq.num_computed = len(tokens)
        self.trie.on_admitted(seq, PrefixMatch(depth * self.bs, list(nodes[:depth]), None), first_admission=False)
        self._checkpoint(seq, len(tokens))
        self.trie.on_released(seq)
        self.block_manager.free(own)


def build(prefix_len: int, num_checkpoints: int, block_size: int, seed: int = 0, dense: bool = False) -> Setup:
    pop = Populator(prefix_len, num_checkpoints, block_size, seed, dense)
    rng = pop.rng
    base = rng.integers(0, VOCAB, prefix_len, dtype=np.int64)
    num_on_path = min(num_checkpoints // 2, MAX_ON_PATH)
    steps = sorted({int(s) for s in np.linspace(prefix_len / num_on_path, prefix_len, num_on_path)})
    nodes = pop.base_path(base, steps)
    rest = num_checkpoints - len(steps)
    num_deep = min(rest, MAX_DEEP)
    shallow_depth = max(1, min(len(nodes), SHALLOW_TOKENS // block_size))
    for i in range(rest):
        depth_limit = len(nodes) if i < num_deep else shallow_depth
        pop.branch(base, nodes, int(rng.integers(0, depth_limit)), int(rng.integers(1, 2 * block_size)))
    assert pop.trie.num_checkpoints == (0 if dense else num_checkpoints), pop.trie.num_checkpoints
    hit = SchedulerSequence(seq_id=-1, token_ids=base.tolist() + rng.integers(0, VOCAB, 7).tolist(),
                            num_prompt_tokens=prefix_len + 7, sampling=SamplingParams())
    miss = SchedulerSequence(seq_id=-2, token_ids=rng.integers(0, VOCAB, prefix_len + 7).tolist(),
                             num_prompt_tokens=prefix_len + 7, sampling=SamplingParams())
    return Setup(pop.trie, hit, miss)


def median_us(fn, repeats: int, setup=None) -> float:
    """Median wall time of `fn(setup())` (or `fn()`); `setup` runs outside the timed region. The garbage collector
    is off while timing, as in `timeit` (a collection of the whole population would land on whichever call it
    interrupts)."""
    times = []
    for _ in range(repeats):
        args = (setup(),) if setup is not None else ()
        gc.disable()
        start = time.perf_counter_ns()
        fn(*args)
        times.append(time.perf_counter_ns() - start)
        gc.enable()
    return statistics.median(times) / 1e3


def fresh(seq: SchedulerSequence, primed: bool = True) -> SchedulerSequence:
    """A new request with the same prompt (nothing memoized); `primed`: its int64 array built, as at submission."""
    copy = SchedulerSequence(seq_id=seq.seq_id, token_ids=list(seq.token_ids),
                             num_prompt_tokens=seq.num_prompt_tokens, sampling=seq.sampling)
    if primed:
        copy.token_array()
    return copy


def measure(setup: Setup, repeats: int) -> dict:
    trie, hit, miss = setup.trie, setup.hit_query, setup.miss_query
    match = trie.match(hit)
    trie.match(miss)
    max_step = hit.num_tokens - 1
    candidates = trie.checkpoint_candidates(hit, max_step)
    ck_bytes = sum(ck.token_ids.nbytes for ck in trie.checkpoints.live()) if trie.checkpoints is not None else 0
    return dict(
        cands=len(candidates), hit=match.num_tokens,
        match_us=median_us(lambda: trie.match(hit), repeats),
        first_us=median_us(trie.match, repeats, setup=lambda: fresh(hit)),
        index_us=median_us(lambda: trie.checkpoint_candidates(hit, max_step), repeats),
        miss_us=median_us(lambda: trie.match(miss), repeats),
        miss_first_us=median_us(trie.match, repeats, setup=lambda: fresh(miss)),
        to_array_us=median_us(lambda q: q.token_array(), repeats, setup=lambda: fresh(hit, primed=False)),
        ck_MB=ck_bytes / 2**20)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--quick', action='store_true', help='small grid (100 / 1k checkpoints x 1K / 16K tokens)')
    parser.add_argument('--dense', action='store_true', help='a dense model: the same population without checkpoints')
    parser.add_argument('--block-size', type=int, default=64)
    parser.add_argument('--repeats', type=int, default=0, help='timed calls per cell (default: 20, quick: 5)')
    args = parser.parse_args()
    checkpoints = (100, 1000) if args.quick else (100, 1000, 10_000)
    prefixes = (1024, 16 * 1024) if args.quick else (1024, 16 * 1024, 128 * 1024)
    repeats = args.repeats or (5 if args.quick else 20)
    header = (f'{"prefix":>7} {"ckpts":>6} {"cands":>6} {"hit":>7} {"match_us":>9} {"first_us":>9} {"index_us":>8} '
              f'{"miss_us":>8} {"miss_first_us":>13} {"to_array_us":>11} {"ck_MB":>7} {"build_s":>7}')
    kind = 'dense (branches without checkpoints)' if args.dense else 'hybrid'
    print(f'BlockTrie.match, {kind}, block_size {args.block_size}, median of {repeats} calls')
    print(header)
    print('-' * len(header))
    for prefix_len in prefixes:
        for num_checkpoints in checkpoints:
            start = time.perf_counter()
            setup = build(prefix_len, num_checkpoints, args.block_size, dense=args.dense)
            build_s = time.perf_counter() - start
            row = measure(setup, repeats)
            print(f'{prefix_len:>7} {num_checkpoints:>6} {row["cands"]:>6} {row["hit"]:>7} {row["match_us"]:>9.1f} '
                  f'{row["first_us"]:>9.1f} {row["index_us"]:>8.1f} {row["miss_us"]:>8.1f} '
                  f'{row["miss_first_us"]:>13.1f} {row["to_array_us"]:>11.1f} {row["ck_MB"]:>7.1f} {build_s:>7.2f}',
                  flush=True)


if __name__ == '__main__':
    main()
