"""The pool-in-place token-by-token gated delta rule (`kernels/cuda/fused_recurrent_gated_delta.py`) against the
default backend's torch kernel, and its verify cuts against the round-by-round form they replace
(`nn/draft_cuts.gated_delta_draft_rounds`: one decode call per token, a row copy after each).

The same case checkers run on the CPU under the Triton interpreter (tiny heads, in a subprocess) and on the GPU
(`@pytest.mark.gpu`, the Qwen3.5 head sizes). Pools are strided views of a wider random tensor, fresh rows hold
NaN; rows and gap bytes the kernel must not write stay bit-identical.
"""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from interpreted import check_cases_interpreted, run_checks_interpreted
from kernel_inputs import compare_pools, cu_seqlens_of, make_pool, randn, strided_copy, tol

from lmdeploy.pytorch.kernels.cuda.fused_recurrent_gated_delta import fused_recurrent_gated_delta_rule
from lmdeploy.pytorch.kernels.cuda.gated_delta_gating import gated_delta_gating
from lmdeploy.pytorch.kernels.default import gated_delta_rule as ref_gdr

_DTYPES = {'fp32': torch.float32, 'bf16': torch.bfloat16}


@dataclass(frozen=True)
class Case:
    lens: tuple[int, ...]
    fresh: tuple[bool, ...]
    heads: int
    k_heads: int
    dim_k: int
    dim_v: int
    dtype: str = 'fp32'
    pool_dtype: str = 'fp32'
    l2norm: bool = True
    cuts: int = 0              # verify shape: every sequence cuts + 1 tokens, states after the first `cuts` saved
    strided: bool = False      # q / k / v as views into wider rows (after a fused projection's split)
    block_v: int = 32

    @property
    def id(self) -> str:
        return (f"L{'_'.join(map(str, self.lens))}-H{self.heads}/{self.k_heads}-D{self.dim_k}x{self.dim_v}-"
                f'{self.dtype}-pool{self.pool_dtype}-c{self.cuts}{"-noL2" if not self.l2norm else ""}'
                f'{"-strided" if self.strided else ""}-bv{self.block_v}')


def _inputs(case: Case, device: str) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(sum(case.lens) * 7 + case.heads)
    total, dtype = sum(case.lens), _DTYPES[case.dtype]
    q, k = randn(total, case.k_heads, case.dim_k, gen=gen), randn(total, case.k_heads, case.dim_k, gen=gen)
    if not case.l2norm:
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    v = randn(total, case.heads, case.dim_v, gen=gen)
    g = F.logsigmoid(randn(total, case.heads, gen=gen) + 2.0)
    beta = torch.sigmoid(randn(total, case.heads, gen=gen))
    out = [x.to(dtype).to(device) for x in (q, k, v)] + [g.to(device), beta.to(dtype).to(device)]
    if case.strided:
        out[:3] = [strided_copy(x) for x in out[:3]]
    return out


def _slot_order(case: Case) -> list[int]:
    """Every pool row in a shuffled order: the sequences' rows first, then their cut rows, two rows spare."""
    num_slots = len(case.lens) * (case.cuts + 1) + 2
    return torch.randperm(num_slots, generator=torch.Generator().manual_seed(num_slots)).tolist()


def _pools(case: Case, device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    order = _slot_order(case)
    backing, pool = make_pool(len(order), case.heads, case.dim_k, case.dim_v, dtype=_DTYPES[case.pool_dtype], seed=3)
    backing.mul_(0.1)
    for slot, fresh in zip(order, case.fresh):
        if fresh:
            pool[slot] = float('nan')
    backing = backing.to(device)
    ref_backing = backing.clone()

    def view(b: torch.Tensor) -> torch.Tensor:
        return b[:, 3:3 + pool[0].numel()].view(pool.shape)
    return backing, view(backing), ref_backing, view(ref_backing)


def _slots(case: Case, device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    batch, order = len(case.lens), _slot_order(case)
    ids = torch.tensor(order[:batch], dtype=torch.int64, device=device)
    fresh = torch.tensor(case.fresh, device=device)
    cuts = None
    if case.cuts:
        cuts = torch.tensor(order[batch:batch + batch * case.cuts], dtype=torch.int64,
                            device=device).view(batch, case.cuts)
    return ids, fresh, cuts


def _rounds(kernel, inputs, pool, ids, fresh, cuts, l2norm: bool) -> torch.Tensor:
    """The verify forward as one decode call per token and a row copy after each (`gated_delta_draft_rounds`)."""
    batch, num_cuts = cuts.shape
    rows = num_cuts + 1
    out = torch.empty_like(inputs[2])
    cu = torch.arange(batch + 1, dtype=torch.int64, device=ids.device)
    for r in range(rows):
        token = [x.unflatten(0, (batch, rows))[:, r].contiguous() for x in inputs]
        out.unflatten(0, (batch, rows))[:, r] = kernel(*token, cu, pool, ids, fresh if r == 0 else
                                                       torch.zeros_like(fresh), use_qk_l2norm=l2norm)
        if r < num_cuts:
            pool[cuts[:, r]] = pool[ids]
    return out


def _same_kernel_tolerance(case: Case, device: str) -> dict:
    """Two forms of one computation by this kernel: bit for bit under the interpreter; compiled, two binaries (a
    constexpr differs) may contract multiply-adds differently, so a float32 rounding or a bf16 ulp."""
    if device == 'cpu':
        return {'rtol': 0, 'atol': 0}
    return {'rtol': 1e-5 if case.dtype == case.pool_dtype == 'fp32' else 8e-3, 'atol': 1e-6}


def check(case: Case, device: str) -> None:
    inputs = _inputs(case, device)
    backing, pool, ref_backing, ref_pool = _pools(case, device)
    ids, fresh, cuts = _slots(case, device)
    cu = cu_seqlens_of(case.lens).to(device)
    got = fused_recurrent_gated_delta_rule(*inputs, cu, pool, ids, fresh, use_qk_l2norm=case.l2norm, cut_slots=cuts,
                                           block_v=case.block_v)
    ref_inputs = [x.cpu() for x in inputs]
    cpu_ref_backing = ref_backing.cpu().clone()   # a copy on the CPU too: `ref_backing` runs the kernel's rounds
    cpu_ref_pool = cpu_ref_backing[:, 3:3 + pool[0].numel()].view(pool.shape)
    if cuts is None:
        want = ref_gdr.recurrent_gated_delta_rule(*ref_inputs, cu.cpu(), cpu_ref_pool, ids.cpu(), fresh.cpu(),
                                                  use_qk_l2norm=case.l2norm)
    else:
        assert set(case.lens) == {case.cuts + 1}
        want = _rounds(ref_gdr.recurrent_gated_delta_rule, ref_inputs, cpu_ref_pool, ids.cpu(), fresh.cpu(),
                       cuts.cpu(), case.l2norm)
        # the kernel's own decode calls with copies: what one launch with cuts computes
        same = _rounds(fused_recurrent_gated_delta_rule, inputs, ref_pool, ids, fresh, cuts, case.l2norm)
        exact = _same_kernel_tolerance(case, device)
        torch.testing.assert_close(same, got, **exact, msg=case.id)
        torch.testing.assert_close(ref_backing, backing, **exact, equal_nan=True, msg=case.id)
    assert got.dtype == inputs[2].dtype and got.shape == inputs[2].shape and torch.isfinite(got).all()
    is_fp32 = case.dtype == 'fp32' and case.pool_dtype == 'fp32'
    close = tol(torch.float32 if is_fp32 else torch.bfloat16, fp32=1e-4, bf16=5e-2)
    torch.testing.assert_close(got.cpu().float(), want.float(), **close, msg=case.id)
    used = list(ids.tolist()) + ([] if cuts is None else cuts.flatten().tolist())
    compare_pools(backing, cpu_ref_backing, pool, used, **close)   # `pool` itself: its storage offset is read


CPU_CASES = [
    Case((1, 1, 1), (False, True, False), 4, 2, 16, 16),                       # decode, GVA, a fresh NaN row
    Case((3, 0, 1, 5), (True, False, False, True), 2, 2, 16, 8, block_v=4),    # varlen, empty, column blocks
    Case((1, 1), (False, False), 2, 1, 8, 16, l2norm=False, strided=True),
    Case((4, 4), (False, True), 2, 1, 16, 16, cuts=3),                         # verify K = 3
    Case((3, 3, 3), (True, False, False), 2, 2, 8, 8, 'bf16', 'bf16', cuts=2, block_v=4),  # rounded per token
    Case((2, 2), (False, False), 2, 2, 8, 8, 'bf16', 'fp32'),
]
GPU_CASES = [
    Case((1,) * 64, (False, True) * 32, 32, 16, 128, 128, 'bf16'),             # Qwen3.5-9B heads, decode
    Case((1,) * 7, (False,) * 7, 16, 16, 128, 128, 'bf16', 'bf16'),
    Case((5, 1, 0, 17), (True, False, True, False), 8, 4, 128, 64, 'bf16'),
    Case((4,) * 8, (False, True) * 4, 32, 16, 128, 128, 'bf16', cuts=3),
    Case((3,) * 5, (False,) * 5, 8, 4, 128, 128, 'bf16', 'bf16', cuts=2),
    Case((2, 2, 2), (False, True, False), 8, 8, 128, 128, 'fp32', cuts=1, strided=True, block_v=64),
    Case((1, 1), (False, False), 4, 2, 128, 128, 'bf16', l2norm=False, block_v=16),
]


def check_folded_gating(case: Case, device: str) -> None:
    """`gating_params`: the kernel's own gating of the raw projections a, b (views into one wider row, as after the
    fused input projection's split) gives what the gating kernel's g, beta give the plain call, in the outputs and
    in every pool byte."""
    q, k, v = _inputs(case, device)[:3]
    gen = torch.Generator().manual_seed(sum(case.lens) + 11)
    rows = randn(sum(case.lens), 2 * case.heads + 3, gen=gen).mul_(3.0).to(_DTYPES[case.dtype]).to(device)
    a, b = rows[:, 1:1 + case.heads], rows[:, 1 + case.heads:1 + 2 * case.heads]
    A_log, dt_bias = randn(case.heads, gen=gen).to(device), randn(case.heads, gen=gen).to(device)
    backing, pool, ref_backing, ref_pool = _pools(case, device)
    ids, fresh, _ = _slots(case, device)
    cu = cu_seqlens_of(case.lens).to(device)
    g, beta = gated_delta_gating(a, b, A_log, dt_bias)
    want = fused_recurrent_gated_delta_rule(q, k, v, g, beta, cu, ref_pool, ids, fresh, use_qk_l2norm=case.l2norm,
                                            block_v=case.block_v)
    got = fused_recurrent_gated_delta_rule(q, k, v, a, b, cu, pool, ids, fresh, use_qk_l2norm=case.l2norm,
                                           gating_params=(A_log, dt_bias), block_v=case.block_v)
    exact = _same_kernel_tolerance(case, device)
    torch.testing.assert_close(got, want, **exact, msg=case.id)
    torch.testing.assert_close(backing, ref_backing, **exact, equal_nan=True, msg=case.id)


GATING_CPU_CASES = [c for c in CPU_CASES if not c.cuts]
GATING_GPU_CASES = [c for c in GPU_CASES if not c.cuts]


def check_out_norm(case: Case, device: str) -> None:
    """`out_norm`: the kernel's gated RMSNorm of its outputs (the last program of each (sequence, head) normalising
    the head's rows) gives what the separate norm kernel gives the plain call's outputs (the engine's unfused pair),
    and the torch norm within the dtype's tolerance; the pool is the plain call's; a second launch gives the same
    (the arrival counters are back at zero)."""
    from lmdeploy.pytorch.backends.default.elementwise import gated_rms_norm as torch_gated_rms_norm
    from lmdeploy.pytorch.kernels.cuda.rms_norm_rows import gated_rms_norm
    q, k, v, g, beta = _inputs(case, device)
    gen = torch.Generator().manual_seed(sum(case.lens) + 17)
    dtype = _DTYPES[case.dtype]
    wide = randn(sum(case.lens), case.heads, case.dim_v + 5, gen=gen).to(dtype).to(device)
    z = wide[..., 2:2 + case.dim_v]                     # a view into wider rows, as z after the projection's split
    norm_w = (1.0 + 0.1 * randn(case.dim_v, gen=gen)).to(dtype).to(device)
    backing, pool, ref_backing, ref_pool = _pools(case, device)
    ids, fresh, _ = _slots(case, device)
    cu = cu_seqlens_of(case.lens).to(device)
    plain = fused_recurrent_gated_delta_rule(q, k, v, g, beta, cu, ref_pool, ids, fresh, use_qk_l2norm=case.l2norm,
                                             block_v=case.block_v)
    want = gated_rms_norm(plain, z, norm_w, 1e-6)
    for _ in range(2):
        pool.copy_(_pools(case, device)[1])
        got = fused_recurrent_gated_delta_rule(q, k, v, g, beta, cu, pool, ids, fresh, use_qk_l2norm=case.l2norm,
                                               out_norm=(z, norm_w, 1e-6), block_v=case.block_v)
        exact = _same_kernel_tolerance(case, device)
        torch.testing.assert_close(got, want, **exact, msg=case.id)
        torch.testing.assert_close(backing, ref_backing, **exact, equal_nan=True, msg=case.id)
    close = tol(dtype, fp32=1e-4, bf16=5e-2)
    torch.testing.assert_close(got.cpu().float(), torch_gated_rms_norm(plain.cpu(), z.cpu(), norm_w.cpu(),
                                                                       1e-6).float(), **close, msg=case.id)


def run_interpreted(kernel: str) -> None:
    """Entry point of the interpreter subprocess."""
    if kernel == 'folded_gating':
        check_cases_interpreted(check_folded_gating, GATING_CPU_CASES)
    elif kernel == 'out_norm':
        check_cases_interpreted(check_out_norm, GATING_CPU_CASES)
    else:
        check_cases_interpreted(check, CPU_CASES)


def test_kernel_under_triton_interpreter():
    run_checks_interpreted(__file__, 'fused_recurrent', len(CPU_CASES))


def test_folded_gating_under_triton_interpreter():
    run_checks_interpreted(__file__, 'folded_gating', len(GATING_CPU_CASES))


def test_out_norm_under_triton_interpreter():
    run_checks_interpreted(__file__, 'out_norm', len(GATING_CPU_CASES))


@pytest.mark.gpu
@pytest.mark.parametrize('case', GATING_GPU_CASES, ids=lambda c: c.id)
@pytest.mark.parametrize('checker', [check_folded_gating, check_out_norm], ids=['gating', 'out_norm'])
def test_folded_gating_and_out_norm_match_the_separate_kernels_gpu(checker, case):
    if not torch.cuda.is_available():
        pytest.skip('needs CUDA')
    checker(case, 'cuda')


@pytest.mark.gpu
@pytest.mark.parametrize('case', GPU_CASES, ids=lambda c: c.id)
def test_fused_recurrent_gated_delta_rule_matches_reference_gpu(case):
    if not torch.cuda.is_available():
        pytest.skip('needs CUDA')
    check(case, 'cuda')


def test_verify_forward_takes_the_backends_draft_cuts_entry_or_falls_back_to_rounds(monkeypatch):
    """`nn.GatedDeltaRule` hands a verify forward (draft cuts, no in-prefill cuts) to the backend op's `draft_cuts`
    entry when it has one and it accepts (the `cuda` pool kernel), else runs one decode call per token."""
    from types import SimpleNamespace

    from lmdeploy.pytorch.nn import gated_delta
    calls = []
    monkeypatch.setattr(gated_delta, 'gated_delta_draft_rounds', lambda *a: calls.append('rounds') or 'rounds')
    module = gated_delta.GatedDeltaRule()
    inputs = SimpleNamespace(draft_state_slots=torch.zeros(1, 3, dtype=torch.int64), state_cuts=None)
    args = (None,) * 6

    def impl(*a, **kw):
        calls.append('plain')
    for accepts in (True, False):
        impl.draft_cuts = lambda *a, use_qk_l2norm, accepts=accepts: 'fused' if accepts else None
        module._impl = impl
        assert module(*args, inputs) == ('fused' if accepts else 'rounds')
    del impl.draft_cuts
    assert module(*args, inputs) == 'rounds' and calls == ['rounds', 'rounds']


def test_decode_takes_the_backends_folded_gating_or_gates_first():
    """`nn.GatedDeltaRule.forward_gating` hands a forward without cuts to the backend op's `with_gating` entry when
    it has one and it accepts (with a gated output norm, that norm's z, weight and eps too), else runs the gating
    module, then the rule, then the norm; a forward with cuts always gates first (its rounds and draft entry take g
    and beta) and norms last."""
    from types import SimpleNamespace

    from lmdeploy.pytorch.nn import gated_delta
    calls = []
    module = gated_delta.GatedDeltaRule()
    plain = SimpleNamespace(draft_state_slots=None, state_cuts=None)

    def impl(q, k, v, g, beta, state, inputs, use_qk_l2norm):
        calls.append(('rule', g, beta))
        return 'rule'

    def gating(a, b, A_log, dt_bias):
        calls.append(('gating', a, b))
        return 'g', 'beta'
    args = ('q', 'k', 'v', 'a', 'b', 'A_log', 'dt_bias', gating, 'state')

    def norm_fn(out, z):
        calls.append(('norm', out, z))
        return 'normed'
    norm_module = type('Norm', (), {'weight': 'w', 'eps': 1e-6, '__call__': lambda self, out, z: norm_fn(out, z)})()
    seen = []
    for accepts in (True, False):
        def with_gating(*a, use_qk_l2norm, out_norm=None, accepts=accepts):
            seen.append(out_norm)
            return 'folded' if accepts else None
        impl.with_gating = with_gating
        module._impl = impl
        assert module.forward_gating(*args, plain) == ('folded' if accepts else 'rule')
        assert module.forward_gating(*args, plain, norm=norm_module, z='z') == ('folded' if accepts else 'normed')
    assert seen == [None, ('z', 'w', 1e-6)] * 2   # the norm's z, weight and eps go to the entry
    assert calls == [('gating', 'a', 'b'), ('rule', 'g', 'beta'), ('gating', 'a', 'b'), ('rule', 'g', 'beta'),
                     ('norm', 'rule', 'z')]
    calls.clear()
    impl.with_gating = lambda *a, use_qk_l2norm, out_norm=None: 'folded'
    verify = SimpleNamespace(draft_state_slots=None, state_cuts='cuts')
    module.forward = lambda q, k, v, g, beta, state, inputs: calls.append(('rule', g, beta)) or 'rule'
    assert module.forward_gating(*args, verify) == 'rule'
    assert module.forward_gating(*args, verify, norm=norm_module, z='z') == 'normed'
    assert calls == [('gating', 'a', 'b'), ('rule', 'g', 'beta')] * 2 + [('norm', 'rule', 'z')]
