"""Triton paged-attention kernels (prefill, split-KV prefill, decode, gathered prefill) against the pure-torch
reference; the cache-copy and KV-fill kernels are `test_kv_cache_kernels.py`.

The same case checkers run twice:
- on the CPU under the Triton interpreter (tiny shapes), in a subprocess started with TRITON_INTERPRET=1, because
  Triton decides at `@triton.jit` time whether a kernel is interpreted;
- on the GPU (`@pytest.mark.gpu`, odd shapes), in this process.

Attention caches are strided K/V views of a packed page pool, as `CacheEngine` builds them (`paged_kv_pool.py`);
every token slot that no sequence owns holds NaN, so a kernel that reads past `kv_len` or through a padded
block-table entry fails loudly.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from interpreted import check_cases_interpreted, run_checks_interpreted
from numeric import assert_close
from paged_kv_pool import DTYPES, assign_pages, fill_history, make_kv_pool

from lmdeploy.pytorch.kernels.cuda import paged_prefill_attention as prefill_mod
from lmdeploy.pytorch.kernels.cuda.activation import sigmoid_gate_mul
from lmdeploy.pytorch.kernels.cuda.gathered_prefill_attention import gathered_prefill_attention, use_gathered_prefill
from lmdeploy.pytorch.kernels.cuda.paged_attention import paged_decode_attention
from lmdeploy.pytorch.kernels.cuda.paged_prefill_attention import paged_prefill_attention, prefill_num_splits
from lmdeploy.pytorch.kernels.default import paged_attention as ref_attn

# (atol, rtol) of the attention output against an fp32 reference computed from the same (rounded) inputs.
TOLERANCE = {'bf16': (2e-2, 2e-2), 'fp16': (4e-3, 4e-3), 'fp32': (1e-4, 1e-4)}

# --------------------------------------------------------------------------------------------- attention


@dataclass(frozen=True)
class AttnCase:
    q_lens: tuple[int, ...]       # new tokens per sequence (all 1 for decode)
    history: tuple[int, ...]      # cached tokens before them
    num_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: str
    num_splits: int = 0           # decode: the split count; prefill: forced key splits (0: the kernel's rule)
    min_split: int = 0            # prefill with forced splits: the least keys per split (0: the kernel's default)
    pack: bool | None = None      # prefill: query heads of a KV head as one tile's rows (None: the kernel's rule)

    @property
    def kv_lens(self) -> list[int]:
        return [q + h for q, h in zip(self.q_lens, self.history, strict=True)]

    def prefill_lens(self, device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`(cu_seqlens_q, q_lens, kv_lens)` (int64, on `device`), in `paged_prefill_attention`'s argument order."""
        q_lens = torch.tensor(self.q_lens, dtype=torch.int64)
        cu_seqlens_q = torch.cat([torch.zeros(1, dtype=torch.int64), q_lens.cumsum(0)])
        kv_lens = torch.tensor(self.kv_lens, dtype=torch.int64)
        return cu_seqlens_q.to(device), q_lens.to(device), kv_lens.to(device)

    @property
    def id(self) -> str:
        splits = f'-S{self.num_splits}' if self.num_splits else ''
        splits += f'-min{self.min_split}' if self.min_split else ''
        splits += '' if self.pack is None else f'-pack{int(self.pack)}'
        return (f'B{len(self.q_lens)}-T{sum(self.q_lens)}-K{max(self.kv_lens, default=0)}-H{self.num_heads}x'
                f'{self.num_kv_heads}-D{self.head_dim}-kbs{self.page_size}-{self.dtype}{splits}')


def attn_inputs(case: AttnCase, device: str):
    gen = torch.Generator().manual_seed(sum(case.kv_lens) * 3 + case.head_dim)
    dtype = DTYPES[case.dtype]
    tables, num_pages = assign_pages(case.kv_lens, case.page_size, gen)
    _, k_cache, v_cache = make_kv_pool(num_pages, case.page_size, case.num_kv_heads, case.head_dim, dtype, device)
    fill_history(k_cache, v_cache, tables, case.kv_lens, gen)
    q = torch.randn(sum(case.q_lens), case.num_heads, case.head_dim, generator=gen).to(device=device, dtype=dtype)
    return q, k_cache, v_cache, tables.to(device)


def reference_attention(case: AttnCase, q, k_cache, v_cache, tables) -> torch.Tensor:
    """fp32 reference on the CPU from the same (already rounded) inputs."""
    out = ref_attn.paged_attention(q.float().cpu(), k_cache.float().cpu(), v_cache.float().cpu(), tables.cpu(),
                                   list(case.q_lens), case.kv_lens, case.head_dim ** -0.5)
    return out


def check_prefill(case: AttnCase, device: str) -> None:
    q, k_cache, v_cache, tables = attn_inputs(case, device)
    split_args = {'num_splits': case.num_splits} if case.num_splits else {}
    if case.min_split:
        split_args['min_split_keys'] = case.min_split
    if case.pack is not None:
        split_args['pack_gqa'] = case.pack
    out = paged_prefill_attention(q, k_cache, v_cache, tables, *case.prefill_lens(device),
                                  max(case.q_lens, default=0), case.head_dim ** -0.5, **split_args)
    assert out.dtype == q.dtype and out.shape == q.shape
    atol, rtol = TOLERANCE[case.dtype]
    assert_close(out, reference_attention(case, q, k_cache, v_cache, tables), atol=atol, rtol=rtol, what=case.id)


def check_decode(case: AttnCase, device: str) -> None:
    """Rows with kv_len 0 (CUDA-graph padding) must come out as zeros."""
    q, k_cache, v_cache, tables = attn_inputs(case, device)
    kv_lens = torch.tensor(case.kv_lens, dtype=torch.int64, device=device)
    out = paged_decode_attention(q, k_cache, v_cache, tables, kv_lens, case.head_dim ** -0.5,
                                 max_num_splits=case.num_splits)
    assert out.dtype == q.dtype and out.shape == q.shape
    live = [i for i, n in enumerate(case.kv_lens) if n > 0]
    live_case = AttnCase(tuple(case.q_lens[i] for i in live), tuple(case.history[i] for i in live), case.num_heads,
                         case.num_kv_heads, case.head_dim, case.page_size, case.dtype)
    expected = torch.zeros(q.shape, dtype=torch.float32)
    expected[live] = reference_attention(live_case, q[live], k_cache, v_cache, tables[live])
    atol, rtol = TOLERANCE[case.dtype]
    assert_close(out, expected, atol=atol, rtol=rtol, what=case.id)
    # gated attention's output gate inside the merge launch: bit-exact against the separate gate launch, with the
    # gate a strided view (the second half of each head's [query, gate] row, as `GatedAttention` splits it)
    gen = torch.Generator().manual_seed(len(case.kv_lens))
    gate = torch.randn(q.shape[0], q.shape[1], 2 * q.shape[2], generator=gen).to(device=device, dtype=q.dtype)
    gate = gate[..., q.shape[2]:]
    gated = paged_decode_attention(q, k_cache, v_cache, tables, kv_lens, case.head_dim ** -0.5,
                                   max_num_splits=case.num_splits, gate=gate)
    assert torch.equal(gated[live], sigmoid_gate_mul(out, gate)[live]), f'{case.id}: gated merge'
    assert_close(gated[live], (out[live].float() * torch.sigmoid(gate[live].float())).cpu(), atol=atol, rtol=rtol,
                 what=f'{case.id} gated')
    assert torch.equal(gated[[i for i in range(len(case.kv_lens)) if i not in live]].float().abs().sum(),
                       torch.tensor(0.0, device=device)), f'{case.id}: padding rows must stay zero'


def decode_case(kv_lens: tuple[int, ...], *args, num_splits: int) -> AttnCase:
    """A decode batch: each sequence feeds its last token (kv_len 0 = a padding row with no query token)."""
    return AttnCase((1,) * len(kv_lens), tuple(n - 1 for n in kv_lens), *args, num_splits=num_splits)


PREFILL_CASES_CPU = [
    AttnCase((1,), (0,), 4, 2, 16, 4, 'fp32'),
    AttnCase((7, 1, 20), (0, 5, 30), 4, 2, 16, 4, 'fp32'),
    AttnCase((3, 0, 9), (70, 5, 0), 4, 1, 80, 16, 'fp32'),      # q_len 0 row; D 80 padded to 128; BLOCK_M crossing
    AttnCase((5, 2), (3, 9), 2, 2, 32, 8, 'fp16'),               # (the interpreter's bf16 tl.dot is broken)
    AttnCase((70, 3), (60, 0), 2, 1, 16, 4, 'fp32'),             # two query tiles, an unmasked key block
    AttnCase((), (), 4, 2, 16, 4, 'fp32'),                       # empty batch
    # Split-KV (the cases above take the default rule: split launch, one active split). Forced splits with tiny
    # minimum lengths: 3 / 2 / 1 active splits per sequence, a q_len-0 row, non-aligned histories.
    AttnCase((5, 20, 1, 0), (300, 70, 0, 9), 4, 2, 16, 4, 'fp32', num_splits=4, min_split=32),
    AttnCase((70, 3), (200, 0), 2, 1, 16, 4, 'fp32', num_splits=3, min_split=32),  # two tiles, 6 and 8 splits' worth
    AttnCase((9,), (130,), 4, 2, 80, 8, 'fp32', num_splits=5, min_split=64),        # 2 of 5 splits active; D 80
    AttnCase((5, 2), (100, 9), 2, 2, 32, 8, 'fp16', num_splits=2, min_split=32),
    AttnCase((9, 3), (700, 40), 4, 2, 16, 4, 'fp32', num_splits=11, min_split=32),  # 11 / 1 active: 2 merge steps
    AttnCase((7, 1, 20), (0, 5, 30), 4, 2, 16, 4, 'fp32', num_splits=1),           # the unsplit launch
    AttnCase((70, 3), (60, 0), 2, 1, 16, 4, 'fp32', num_splits=1),
    # Grouped heads packed into their KV head's tiles (`pack_gqa`, the default of split launches), split and not.
    AttnCase((5, 20, 1, 0), (300, 70, 0, 9), 4, 2, 16, 4, 'fp32', num_splits=4, min_split=32, pack=True),
    AttnCase((9, 3), (700, 40), 8, 2, 16, 4, 'fp32', num_splits=5, min_split=32, pack=True),  # 4 heads a group
    AttnCase((70, 3), (200, 0), 4, 2, 16, 4, 'fp32', num_splits=3, min_split=32, pack=True),  # several tiles
    AttnCase((7, 1, 20), (0, 5, 30), 4, 2, 16, 4, 'fp32', num_splits=1, pack=True),  # packed, unsplit
    AttnCase((9, 3), (200, 40), 6, 2, 16, 4, 'fp32', num_splits=3, min_split=32, pack=True),  # 3 heads a group
    AttnCase((5, 17), (90, 0), 16, 1, 16, 4, 'fp32', num_splits=2, min_split=32, pack=True),  # 16 heads a group
    AttnCase((9,), (130,), 4, 2, 80, 8, 'fp32', num_splits=5, min_split=64, pack=True),       # D 80 padded
]

DECODE_CASES_CPU = [
    decode_case((1,), 4, 2, 16, 4, 'fp32', num_splits=1),
    decode_case((1, 6, 37), 4, 2, 16, 4, 'fp32', num_splits=4),
    decode_case((70, 0, 5), 4, 1, 80, 16, 'fp32', num_splits=3),  # padding row; D 80
    decode_case((9, 130), 2, 2, 32, 8, 'fp16', num_splits=2),
]

_PREFILL_SEQS = [
    ((1,), (0,)),                       # one-token sequence, no history
    ((7, 1, 64), (0, 5, 300)),
    ((130, 64, 7), (5, 300, 0)),
    ((0, 130, 1, 7), (5, 300, 0, 300)),  # a sequence with no new tokens in the batch
]
# Each head_dim with both page sizes and both dtypes, paired (kbs 16 + bf16, kbs 64 + fp32): half the Triton
# specializations of the full product, so the file fits a loaded GPU run.
_PAGE_DTYPES = ((16, 'bf16'), (64, 'fp32'))
PREFILL_CASES_GPU = [
    AttnCase(q_lens, hist, 16, 2, d, kbs, dtype)
    for q_lens, hist in _PREFILL_SEQS for d in (64, 128, 256) for kbs, dtype in _PAGE_DTYPES
] + [
    AttnCase((), (), 16, 2, 128, 16, 'bf16'),
    AttnCase((130, 7), (300, 5), 16, 2, 80, 16, 'bf16'),
    AttnCase((130, 7), (300, 5), 8, 8, 128, 64, 'fp16'),
    AttnCase((1000, 1), (37, 2000), 32, 4, 128, 64, 'bf16'),
] + [
    # Split-KV: short queries after long, non-aligned histories (the default rule splits these up to 32 ways).
    AttnCase(q_lens, hist, 16, 4, d, kbs, dtype)
    for q_lens, hist in [((100, 7, 1), (5_003, 300, 9_001)), ((130, 0, 64), (2_000, 7, 0))]
    for d in (128, 256) for kbs, dtype in ((64, 'bf16'), (16, 'fp32'))
] + [
    AttnCase((100,), (32_700,), 16, 4, 256, 64, 'bf16'),        # the 9B suffix row's shape
    AttnCase((100,), (32_700,), 16, 2, 256, 64, 'bf16'),        # the MoE shapes' (8 query heads a KV head)
    AttnCase((100,), (32_700,), 16, 2, 256, 64, 'bf16', pack=True),
    AttnCase((100, 7, 1), (5_003, 300, 9_001), 16, 2, 128, 16, 'fp32', num_splits=6, min_split=64, pack=True),
    AttnCase((100,), (32_700,), 16, 4, 128, 16, 'fp32'),
    AttnCase((100, 70), (4_001, 1_000), 16, 4, 256, 64, 'bf16', num_splits=7, min_split=64),
    AttnCase((300,), (3_000,), 16, 4, 256, 16, 'bf16', num_splits=1),
    AttnCase((33, 1), (20_000, 129), 8, 8, 80, 16, 'fp16'),
]

_DECODE_LENS = [(1,), (1, 6, 301), (300, 1000, 17, 64, 65), (5, 0, 300)]
DECODE_CASES_GPU = [
    decode_case(kv_lens, 16, 2, d, kbs, dtype, num_splits=splits)
    for kv_lens in _DECODE_LENS for d in (64, 128, 256) for kbs in (16, 64) for dtype in ('bf16', 'fp32')
    for splits in (1, 16)
] + [
    decode_case((), 16, 2, 128, 16, 'bf16', num_splits=16),
    decode_case((1, 6, 301), 16, 2, 80, 16, 'bf16', num_splits=5),
    decode_case((4097, 33), 8, 8, 128, 64, 'fp16', num_splits=32),
    decode_case((2000, 1, 900), 32, 4, 128, 64, 'bf16', num_splits=8),
]



# --------------------------------------------------------------------------------------------- CPU (interpreter)


_CHECKS = {
    'paged_prefill_attention': (check_prefill, PREFILL_CASES_CPU),
    'paged_decode_attention': (check_decode, DECODE_CASES_CPU),
}


def run_interpreted(kernel: str) -> None:
    """Entry point of the interpreter subprocess: every CPU case of one kernel."""
    check_cases_interpreted(*_CHECKS[kernel])


@pytest.mark.parametrize('kernel', list(_CHECKS))
def test_kernel_under_triton_interpreter(kernel):
    run_checks_interpreted(__file__, kernel, len(_CHECKS[kernel][1]))


# --------------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize('case', PREFILL_CASES_GPU, ids=lambda c: c.id)
def test_paged_prefill_attention_matches_reference(case):
    check_prefill(case, 'cuda')


@pytest.mark.gpu
@pytest.mark.parametrize('case', DECODE_CASES_GPU, ids=lambda c: c.id)
def test_paged_decode_attention_matches_reference(case):
    check_decode(case, 'cuda')


def check_gathered_prefill(case: AttnCase, device: str) -> None:
    q, k_cache, v_cache, tables = attn_inputs(case, device)
    out = gathered_prefill_attention(q, k_cache, v_cache, tables, list(case.q_lens), case.kv_lens,
                                     case.head_dim ** -0.5)
    assert out.dtype == q.dtype and out.shape == q.shape
    atol, rtol = TOLERANCE[case.dtype]
    assert_close(out, reference_attention(case, q, k_cache, v_cache, tables), atol=atol, rtol=rtol, what=case.id)


GATHERED_CASES_CPU = [
    AttnCase((70, 3), (60, 0), 4, 2, 16, 4, 'fp32'),
    AttnCase((5, 20, 1, 0), (300, 70, 0, 9), 4, 2, 16, 4, 'fp32'),  # a q_len-0 row, non-aligned histories
    AttnCase((9,), (130,), 4, 1, 80, 8, 'fp16'),
]
GATHERED_CASES_GPU = [
    AttnCase(q_lens, hist, 16, 4, d, kbs, 'bf16')
    for q_lens, hist in [((1200,), (0,)), ((1000, 300), (3_001, 0))] for d in (128, 256) for kbs in (16, 64)
]


@pytest.mark.parametrize('case', GATHERED_CASES_CPU, ids=lambda c: c.id)
def test_gathered_prefill_attention_matches_reference_on_cpu(case):
    check_gathered_prefill(case, 'cpu')


@pytest.mark.gpu
@pytest.mark.parametrize('case', GATHERED_CASES_GPU, ids=lambda c: c.id)
def test_gathered_prefill_attention_matches_reference(case):
    check_gathered_prefill(case, 'cuda')


def test_gathered_prefill_only_for_long_eager_chunks_of_few_sequences():
    assert use_gathered_prefill([8192], True) and use_gathered_prefill([1, 2048, 5], True)
    assert not use_gathered_prefill([8192], False)           # a CUDA-graph view: placeholder host lengths
    assert not use_gathered_prefill([2047, 100], True)
    assert not use_gathered_prefill([4096] * 5, True) and not use_gathered_prefill([], True)


def test_prefill_split_rule_fills_the_gpu_only_for_short_queries():
    # 100 tokens (graph bucket 128) x 16 heads, BLOCK_M 128: 16 tiles, 132 // 16 = 8 splits fill one wave of the
    # 132 SMs (the partials' cap, 128 x 16 x (256 + 1) x 4 bytes per split in 64 MiB, would allow 31)
    assert prefill_num_splits(128, 16, 256, 128, 132) == 8
    assert prefill_num_splits(128, 16, 256, 64, 132) == 4           # 32 tiles
    assert prefill_num_splits(128, 2, 128, 128, 132) == prefill_mod.MAX_SPLITS
    assert prefill_num_splits(512, 16, 256, 128, 132) == 2          # 64 tiles: two splits just fit
    assert prefill_num_splits(1024, 16, 256, 128, 132) == 1         # 128 tiles: already one wave
    assert prefill_num_splits(8192, 16, 256, 128, 132) == 1         # cold chunks: enough tiles already
    assert prefill_num_splits(2048, 64, 256, 128, 132) == 1
    assert prefill_num_splits(4096, 2, 256, 128, 132) == 2          # 64 tiles
    assert prefill_num_splits(4096, 1, 256, 128, 132) == 4          # 32 tiles: 132 // 32 (memory allows 15)
    assert prefill_num_splits(128, 1, 256, 128, 132) == prefill_mod.MAX_SPLITS  # 1 tile: 132 capped
    # 8 tiles would take 16 splits; a split's partial is 1024 x 4096 x 4 bytes = 16 MiB, so 4 fit in 64 MiB
    assert prefill_num_splits(1024, 1, 4095, 128, 132) == 4


def capture(launch: Callable[[], torch.Tensor]) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """`launch()` once eagerly (compiles, warms up), then captured: the graph and its static output."""
    launch()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = launch()
    return graph, out


@pytest.mark.gpu
def test_paged_prefill_attention_replays_in_cuda_graph_with_new_lengths():
    """Split-KV prefill captured at one set of lengths, replayed after q_lens / kv_lens / tables change in place:
    the same result as an eager launch at the new lengths (same split decision), and the reference's."""
    first = AttnCase((100, 28, 0, 0), (200, 0, 0, 0), 16, 4, 256, 64, 'bf16')
    second = AttnCase((60, 68, 0, 0), (30_000, 5, 0, 0), 16, 4, 256, 64, 'bf16')
    q, k_cache, v_cache, tables = attn_inputs(second, 'cuda')
    scale = second.head_dim ** -0.5
    static_lens = first.prefill_lens('cuda')
    static_tables = torch.zeros_like(tables)
    graph, static_out = capture(lambda: paged_prefill_attention(q, k_cache, v_cache, static_tables, *static_lens, 128,
                                                                scale))
    for static, new in zip(static_lens, second.prefill_lens('cuda')):
        static.copy_(new)
    static_tables.copy_(tables)
    graph.replay()
    expected = paged_prefill_attention(q, k_cache, v_cache, tables, *second.prefill_lens('cuda'), 128, scale)
    assert torch.equal(static_out, expected)
    assert_close(static_out, reference_attention(second, q, k_cache, v_cache, tables), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
def test_paged_decode_attention_replays_in_cuda_graph_with_new_lengths():
    """Captured once at kv_lens (5, 300, 1); replayed after the lengths and tables change in place."""
    first = decode_case((5, 300, 1), 16, 2, 128, 16, 'bf16', num_splits=8)
    second = decode_case((700, 2, 0), 16, 2, 128, 16, 'bf16', num_splits=8)
    q, k_cache, v_cache, tables = attn_inputs(second, 'cuda')
    static_q = q.clone()
    static_tables = tables.clone()
    static_kv_lens = torch.tensor(first.kv_lens, dtype=torch.int64, device='cuda')
    scale = first.head_dim ** -0.5
    graph, static_out = capture(lambda: paged_decode_attention(static_q, k_cache, v_cache, static_tables,
                                                               static_kv_lens, scale, max_num_splits=8))
    static_kv_lens.copy_(torch.tensor(second.kv_lens, device='cuda'))
    graph.replay()
    expected = paged_decode_attention(q, k_cache, v_cache, tables, static_kv_lens.clone(), scale, max_num_splits=8)
    assert torch.equal(static_out, expected)
    live = [0, 1]
    live_case = decode_case((700, 2), 16, 2, 128, 16, 'bf16', num_splits=8)
    ref = reference_attention(live_case, q[live], k_cache, v_cache, tables[live])
    assert_close(static_out[live], ref, atol=2e-2, rtol=2e-2)
    assert not static_out[2].any()
