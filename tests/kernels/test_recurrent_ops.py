"""Default-backend recurrent ops: gated delta rule (chunk / recurrent) and causal conv1d, against references."""

import inspect
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from kernel_inputs import cu_seqlens_of, make_pool

from lmdeploy.pytorch.kernels.default.causal_conv1d import causal_conv1d
from lmdeploy.pytorch.kernels.default.gated_delta_rule import chunk_gated_delta_rule, recurrent_gated_delta_rule

hf_qwen3_next = pytest.importorskip('transformers.models.qwen3_next.modeling_qwen3_next')
# unwrap the hub-kernel decorators so the pure-torch code path is always the reference
hf_chunk = inspect.unwrap(hf_qwen3_next.torch_chunk_gated_delta_rule)
hf_recurrent = inspect.unwrap(hf_qwen3_next.torch_recurrent_gated_delta_rule)

ATOL = RTOL = 1e-4
NUM_SLOTS = 8


def assert_untouched(before: torch.Tensor, after: torch.Tensor, pool: torch.Tensor, used_slots) -> None:
    """Slots not in `used_slots` and the gap bytes around every row are bit-identical (NaN-aware)."""
    mask = torch.ones_like(before, dtype=torch.bool)
    start = pool.storage_offset()
    for slot in used_slots:
        mask[slot, start:start + pool[0].numel()] = False
    torch.testing.assert_close(after[mask], before[mask], rtol=0, atol=0, equal_nan=True)


# --------------------------------------------------------------------------------------------- gated delta rule


@dataclass
class GdrCase:
    lens: tuple[int, ...]
    fresh: tuple[bool, ...]
    num_heads: int
    dim_k: int
    dim_v: int
    num_k_heads: int | None = None

    @property
    def slots(self) -> list[int]:
        order = [6, 1, 4, 0, 3, 7, 2, 5]
        return order[:len(self.lens)]


def gdr_inputs(case: GdrCase, seed: int = 0, dtype=torch.float32, normalize: bool = False):
    gen = torch.Generator().manual_seed(seed)
    total, hv, hk = sum(case.lens), case.num_heads, case.num_k_heads or case.num_heads
    q = torch.randn(total, hk, case.dim_k, generator=gen)
    k = torch.randn(total, hk, case.dim_k, generator=gen)
    if normalize:
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    v = torch.randn(total, hv, case.dim_v, generator=gen)
    g = F.logsigmoid(torch.randn(total, hv, generator=gen) + 2.0)
    beta = torch.sigmoid(torch.randn(total, hv, generator=gen))
    return tuple(x.to(dtype) for x in (q, k, v, g, beta))


def gdr_pool(case: GdrCase, dtype=torch.float32):
    """Pool with random stale states; fresh sequences' slots hold NaN garbage."""
    backing, pool = make_pool(NUM_SLOTS, case.num_heads, case.dim_k, case.dim_v, dtype=dtype)
    for slot, fresh in zip(case.slots, case.fresh, strict=True):
        if fresh:
            pool[slot] = float('nan')
    return backing, pool


def run_kernel(kernel, case: GdrCase, inputs, pool, **kwargs) -> torch.Tensor:
    state_ids = torch.tensor(case.slots, dtype=torch.int64)
    is_fresh = torch.tensor(case.fresh, dtype=torch.bool)
    return kernel(*inputs, cu_seqlens_of(case.lens), pool, state_ids, is_fresh, **kwargs)


def run_hf(hf_fn, case: GdrCase, inputs, pool, use_qk_l2norm: bool = True):
    """Per-sequence transformers reference; returns (packed output, list of final states)."""
    outs, finals = [], []
    bounds = cu_seqlens_of(case.lens).tolist()
    for b, (slot, fresh) in enumerate(zip(case.slots, case.fresh, strict=True)):
        init = torch.zeros_like(pool[slot], dtype=torch.float32) if fresh else pool[slot].float()
        seq = [x[bounds[b]:bounds[b + 1]] for x in inputs]
        ratio = seq[2].size(1) // seq[0].size(1)
        if ratio > 1:  # older transformers references expect q/k already expanded to the value heads
            seq[0], seq[1] = (x.repeat_interleave(ratio, dim=1) for x in seq[:2])
        if not case.lens[b]:
            outs.append(seq[2])
            finals.append(init)
            continue
        o, s = hf_fn(*(x[None] for x in seq), initial_state=init[None], output_final_state=True,
                     use_qk_l2norm_in_kernel=use_qk_l2norm)
        outs.append(o[0])
        finals.append(s[0])
    return torch.cat(outs), finals


def gdr_id(case: GdrCase) -> str:
    heads = f'H{case.num_heads}' if case.num_k_heads is None else f'Hk{case.num_k_heads}-Hv{case.num_heads}'
    return f'T{case.lens[0]}-{heads}-Dk{case.dim_k}-Dv{case.dim_v}'


# packs: (T, 3, empty fresh, T + 1, empty stale) with mixed freshness and out-of-order slots
_SHAPES = [(1, 2, 8), (2, 3, 32), (3, 4, 8), (63, 4, 32), (64, 2, 32), (65, 3, 8), (130, 4, 32)]
GDR_CASES = [
    GdrCase(lens=(t, 3, 0, t + 1, 0), fresh=(True, False, True, False, False), num_heads=h, dim_k=16, dim_v=dv)
    for t, h, dv in _SHAPES
]
GQA_CASE = GdrCase(lens=(70, 1, 5), fresh=(False, True, False), num_heads=4, dim_k=16, dim_v=8, num_k_heads=2)
ALL_GDR_CASES = pytest.mark.parametrize('case', [*GDR_CASES, GQA_CASE], ids=gdr_id)


def check_against_hf(kernel, hf_fn, case: GdrCase, use_qk_l2norm: bool = True, **kwargs) -> None:
    inputs = gdr_inputs(case, normalize=not use_qk_l2norm)
    backing, pool = gdr_pool(case)
    before = backing.clone()
    ref_out, ref_states = run_hf(hf_fn, case, inputs, pool, use_qk_l2norm)
    out = run_kernel(kernel, case, inputs, pool, use_qk_l2norm=use_qk_l2norm, **kwargs)
    torch.testing.assert_close(out, ref_out, atol=ATOL, rtol=RTOL)
    for slot, ref in zip(case.slots, ref_states, strict=True):
        torch.testing.assert_close(pool[slot], ref, atol=ATOL, rtol=RTOL)
    assert_untouched(before, backing, pool, case.slots)


@ALL_GDR_CASES
def test_chunk_matches_hf(case):
    check_against_hf(chunk_gated_delta_rule, hf_chunk, case)


@ALL_GDR_CASES
def test_recurrent_matches_hf(case):
    check_against_hf(recurrent_gated_delta_rule, hf_recurrent, case)


@pytest.mark.parametrize('kernel', [chunk_gated_delta_rule, recurrent_gated_delta_rule], ids=['chunk', 'recurrent'])
def test_without_l2norm_matches_hf(kernel):
    hf_fn = hf_chunk if kernel is chunk_gated_delta_rule else hf_recurrent
    check_against_hf(kernel, hf_fn, GDR_CASES[5], use_qk_l2norm=False)


@pytest.mark.parametrize('chunk_size', [16, 32, 128])
def test_chunk_size_invariance(chunk_size):
    check_against_hf(chunk_gated_delta_rule, hf_chunk, GDR_CASES[-1], chunk_size=chunk_size)


@ALL_GDR_CASES
def test_recurrent_equals_chunk(case):
    inputs = gdr_inputs(case, seed=1)
    _, pool_chunk = gdr_pool(case)
    _, pool_rec = gdr_pool(case)
    out_chunk = run_kernel(chunk_gated_delta_rule, case, inputs, pool_chunk)
    out_rec = run_kernel(recurrent_gated_delta_rule, case, inputs, pool_rec)
    torch.testing.assert_close(out_rec, out_chunk, atol=ATOL, rtol=RTOL)
    for slot in case.slots:
        torch.testing.assert_close(pool_rec[slot], pool_chunk[slot], atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize('fresh', [True, False], ids=['fresh', 'stale'])
def test_zero_length_sequence_state(fresh):
    case = GdrCase(lens=(0,), fresh=(fresh,), num_heads=2, dim_k=16, dim_v=8)
    for kernel in (chunk_gated_delta_rule, recurrent_gated_delta_rule):
        backing, pool = gdr_pool(case)
        before = pool[case.slots[0]].clone()
        out = run_kernel(kernel, case, gdr_inputs(case), pool)
        assert out.shape == (0, 2, 8)
        expect = torch.zeros_like(before) if fresh else before
        torch.testing.assert_close(pool[case.slots[0]], expect, rtol=0, atol=0)


SPLITS = [(37,), (20, 14, 1, 2), (1, 1, 35), (64, 1), (3, 30, 4)]


@pytest.mark.parametrize('pieces', SPLITS[1:], ids=lambda p: 'split-' + '+'.join(map(str, p)))
def test_split_sequence_matches_single_call(pieces):
    whole = GdrCase(lens=(sum(pieces),), fresh=(True,), num_heads=3, dim_k=16, dim_v=32)
    inputs = gdr_inputs(whole, seed=2)
    _, pool_whole = gdr_pool(whole)
    ref_out = run_kernel(chunk_gated_delta_rule, whole, inputs, pool_whole)

    _, pool = gdr_pool(whole)
    outs, start = [], 0
    for i, n in enumerate(pieces):
        piece = GdrCase(lens=(n,), fresh=(i == 0,), num_heads=3, dim_k=16, dim_v=32)
        kernel = recurrent_gated_delta_rule if n <= 2 else chunk_gated_delta_rule
        outs.append(run_kernel(kernel, piece, [x[start:start + n] for x in inputs], pool))
        start += n
    torch.testing.assert_close(torch.cat(outs), ref_out, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(pool[whole.slots[0]], pool_whole[whole.slots[0]], atol=ATOL, rtol=RTOL)


def test_decode_batch_single_tokens():
    """A decode step (every sequence one token) through the recurrent kernel matches the chunk kernel."""
    case = GdrCase(lens=(1, 1, 1, 1), fresh=(False, True, False, False), num_heads=4, dim_k=16, dim_v=8)
    inputs = gdr_inputs(case, seed=3)
    _, pool_a = gdr_pool(case)
    _, pool_b = gdr_pool(case)
    out_a = run_kernel(recurrent_gated_delta_rule, case, inputs, pool_a)
    out_b = run_kernel(chunk_gated_delta_rule, case, inputs, pool_b)
    torch.testing.assert_close(out_a, out_b, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(pool_a, pool_b, atol=ATOL, rtol=RTOL, equal_nan=True)


@pytest.mark.parametrize('kernel', [chunk_gated_delta_rule, recurrent_gated_delta_rule], ids=['chunk', 'recurrent'])
def test_bf16_pool_and_inputs(kernel):
    case = GDR_CASES[3]
    inputs = gdr_inputs(case, seed=4, dtype=torch.bfloat16)
    _, pool = gdr_pool(case, dtype=torch.bfloat16)
    ref_out, ref_states = run_hf(hf_chunk, case, [x.float() for x in inputs], pool)
    out = run_kernel(kernel, case, inputs, pool)
    assert out.dtype == torch.bfloat16 and pool.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref_out, atol=2e-2, rtol=2e-2)
    for slot, ref in zip(case.slots, ref_states, strict=True):
        torch.testing.assert_close(pool[slot].float(), ref, atol=2e-2, rtol=2e-2)


# ------------------------------------------------------------------------------------------------ causal conv1d


def conv_reference(history: torch.Tensor, x: torch.Tensor, weight, bias, activation='silu') -> torch.Tensor:
    """Full causal depthwise conv over [history, x] ([C, *] layout) with zero left padding; outputs for x only."""
    full = torch.cat([history, x], dim=-1)
    width = weight.shape[-1]
    y = F.conv1d(full[None], weight[:, None], bias, padding=width - 1, groups=full.shape[0])[0, :, :full.shape[-1]]
    y = y[:, history.shape[-1]:]
    return (F.silu(y) if activation == 'silu' else y).t()


def conv_params(channels: int, width: int, seed: int = 0, with_bias: bool = True):
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(channels, width, generator=gen)
    bias = torch.randn(channels, generator=gen) if with_bias else None
    return weight, bias


def last_columns(seq: torch.Tensor, n: int) -> torch.Tensor:
    """Last n columns of [zeros(n), seq] for a [C, L] sequence."""
    return torch.cat([seq.new_zeros(seq.shape[0], n), seq], dim=-1)[:, seq.shape[-1]:]


def run_conv(x, weight, bias, pool, slots, fresh, lens, activation='silu') -> torch.Tensor:
    return causal_conv1d(x, weight, bias, pool, torch.tensor(slots, dtype=torch.int64),
                         torch.tensor(fresh, dtype=torch.bool), cu_seqlens_of(lens), activation=activation)


CONV_CASES = [
    # (lens, history lengths of past inputs (0 => fresh), width, channels)
    ((5, 1, 2, 3, 0, 9), (0, 7, 1, 2, 4, 0), 4, 6),
    ((1, 1, 1), (3, 0, 10), 4, 5),
    ((17, 2), (5, 0), 2, 3),
    ((4, 3), (0, 1), 3, 8),
]


@pytest.mark.parametrize('activation', ['silu', None], ids=['silu', 'noact'])
@pytest.mark.parametrize('case', CONV_CASES, ids=lambda c: 'L' + '_'.join(map(str, c[0])) + f'-K{c[2]}-C{c[3]}')
def test_conv_matches_full_sequence_reference(case, activation):
    lens, past_lens, width, channels = case
    weight, bias = conv_params(channels, width)
    gen = torch.Generator().manual_seed(1)
    pasts = [torch.randn(channels, n, generator=gen) for n in past_lens]
    xs = [torch.randn(channels, n, generator=gen) for n in lens]
    slots = [6, 1, 4, 0, 3, 7][:len(lens)]
    fresh = [n == 0 for n in past_lens]
    backing, pool = make_pool(NUM_SLOTS, channels, width - 1)
    for slot, past, is_fresh in zip(slots, pasts, fresh, strict=True):
        pool[slot] = float('nan') if is_fresh else last_columns(past, width - 1)
    before = backing.clone()

    y = run_conv(torch.cat(xs, dim=-1).t().contiguous(), weight, bias, pool, slots, fresh, lens, activation)
    ref = torch.cat([conv_reference(p, x, weight, bias, activation) for p, x in zip(pasts, xs, strict=True)])
    assert torch.isfinite(y).all()
    torch.testing.assert_close(y, ref, atol=1e-5, rtol=1e-5)
    for slot, past, x in zip(slots, pasts, xs, strict=True):
        torch.testing.assert_close(pool[slot], last_columns(torch.cat([past, x], -1), width - 1), rtol=0, atol=0)
    assert_untouched(before, backing, pool, slots)


@pytest.mark.parametrize('pieces', [(1,) * 9, (2,) * 5, (3,) * 4, (1, 2, 3, 1, 2, 3, 1)],
                         ids=lambda p: 'pieces-' + '+'.join(map(str, p)))
def test_conv_split_equals_unsplit(pieces):
    channels, width = 5, 4
    weight, bias = conv_params(channels, width, seed=2)
    x = torch.randn(sum(pieces), channels, generator=torch.Generator().manual_seed(3))
    _, pool_ref = make_pool(NUM_SLOTS, channels, width - 1)
    ref = run_conv(x, weight, bias, pool_ref, [2], [True], [len(x)])

    _, pool = make_pool(NUM_SLOTS, channels, width - 1)
    pool[2] = float('nan')
    outs, start = [], 0
    for i, n in enumerate(pieces):
        outs.append(run_conv(x[start:start + n], weight, bias, pool, [2], [i == 0], [n]))
        start += n
    torch.testing.assert_close(torch.cat(outs), ref, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(pool[2], pool_ref[2], rtol=0, atol=0)


def test_conv_neighbours_do_not_leak():
    """Each sequence of a packed batch gives the same result as when run alone."""
    channels, width, lens = 4, 4, (2, 1, 3, 5)
    weight, bias = conv_params(channels, width, seed=4)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(sum(lens), channels, generator=gen) * 10
    slots, fresh = [3, 0, 5, 1], [False, True, False, True]
    _, pool = make_pool(NUM_SLOTS, channels, width - 1, seed=6)
    _, solo_pool = make_pool(NUM_SLOTS, channels, width - 1, seed=6)
    packed = run_conv(x, weight, bias, pool, slots, fresh, lens)
    bounds = cu_seqlens_of(lens).tolist()
    for b, (slot, is_fresh) in enumerate(zip(slots, fresh, strict=True)):
        seg = slice(bounds[b], bounds[b + 1])
        solo = run_conv(x[seg], weight, bias, solo_pool, [slot], [is_fresh], [lens[b]])
        torch.testing.assert_close(packed[seg], solo, rtol=1e-6, atol=1e-5)
        torch.testing.assert_close(pool[slot], solo_pool[slot], rtol=0, atol=0)


@pytest.mark.parametrize('num_tokens', range(0, 7), ids=lambda n: f'N{n}')
def test_conv_state_holds_last_inputs(num_tokens):
    channels, width = 3, 4
    weight, bias = conv_params(channels, width)
    x = torch.randn(num_tokens, channels)
    _, pool = make_pool(NUM_SLOTS, channels, width - 1)
    pool[5] = float('nan')
    y = run_conv(x, weight, bias, pool, [5], [True], [num_tokens])
    assert y.shape == (num_tokens, channels) and torch.isfinite(y).all()
    torch.testing.assert_close(pool[5], last_columns(x.t(), width - 1), rtol=0, atol=0)


def test_conv_zero_length_keeps_or_zeroes_state():
    channels, width = 3, 4
    weight, bias = conv_params(channels, width)
    _, pool = make_pool(NUM_SLOTS, channels, width - 1)
    kept = pool[1].clone()
    y = run_conv(torch.zeros(0, channels), weight, bias, pool, [1, 2], [False, True], [0, 0])
    assert y.shape == (0, channels)
    torch.testing.assert_close(pool[1], kept, rtol=0, atol=0)
    torch.testing.assert_close(pool[2], torch.zeros_like(kept), rtol=0, atol=0)


def test_conv_bf16():
    channels, width, lens = 8, 4, (5, 2)
    weight, bias = conv_params(channels, width)
    x = torch.randn(sum(lens), channels).bfloat16()
    _, pool = make_pool(NUM_SLOTS, channels, width - 1, dtype=torch.bfloat16)
    pasts = [pool[0].float(), torch.zeros(channels, width - 1)]
    y = run_conv(x, weight.bfloat16(), bias.bfloat16(), pool, [0, 4], [False, True], lens)
    assert y.dtype == torch.bfloat16 and pool.dtype == torch.bfloat16
    xs = x.float().t().split(lens, dim=-1)
    ref = torch.cat([conv_reference(p, s, weight.bfloat16().float(), bias.bfloat16().float())
                     for p, s in zip(pasts, xs, strict=True)])
    torch.testing.assert_close(y.float(), ref, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(pool[4].float(), last_columns(xs[1], width - 1), rtol=0, atol=0)


def test_bad_activation_rejected():
    weight, bias = conv_params(2, 4)
    _, pool = make_pool(2, 2, 3)
    with pytest.raises(ValueError):
        run_conv(torch.zeros(1, 2), weight, bias, pool, [0], [True], [1], activation='gelu')
