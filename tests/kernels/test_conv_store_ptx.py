"""The conv kernel's store forms in the PTX Triton compiles for Hopper (sm90), offline: no GPU is needed, only
Triton's CUDA backend, which its wheel carries.

`_conv_tokens_kernel` stores through the per-column plane layout, whose offsets hide their alignment from the
compiler: element by element (`st.global.b16`), the suspected cause of the kernel's 3.8x its copy floor (H100 run
73, `docs/benchmarks.md`). With ALIGNED (`LMDEPLOY_CONV_VECTOR_STORES=1`, channels and plane bounds multiples of 8)
a channel block inside one plane stores 16-byte vectors. Compiled with the specialization the model shapes get
(pointers 16-byte aligned; the token count, channel count, row strides and plane bounds divisible by 16), and
with only the row strides so.
"""
from __future__ import annotations

import re
from collections import Counter

import pytest

triton = pytest.importorskip('triton')

from lmdeploy.pytorch.kernels.cuda import causal_conv1d  # noqa: E402

_POINTERS = {'x_ptr': '*bf16', 'w_ptr': '*bf16', 'bias_ptr': '*bf16', 'state_ptr': '*bf16', 'out_ptr': '*bf16',
             'seq_of_token_ptr': '*i64', 'cu_seqlens_ptr': '*i64', 'state_ids_ptr': '*i64', 'fresh_ptr': '*u8'}
_DIVISIBLE = ('num_tokens', 'channels', 'stride_xt', 'stride_s0', 'bound1', 'bound2', 'bound3')


def global_memory_ops(aligned: bool, divisible=_DIVISIBLE) -> tuple[Counter, Counter]:
    """(stores, loads) of the compiled kernel's PTX, by instruction form; `divisible`: the int arguments Triton
    specializes as multiples of 16."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    if 'nvidia' not in getattr(triton.backends, 'backends', {}):
        pytest.skip("this Triton has no CUDA backend")
    fn = causal_conv1d._conv_tokens_kernel.fn
    if not isinstance(fn, triton.runtime.jit.JITFunction):
        pytest.skip('Triton runs interpreted here')
    names = fn.arg_names
    constexprs = dict(KERNEL=4, HAS_BIAS=False, SILU=True, BLOCK_T=16, BLOCK_C=128, ALIGNED=aligned, PDL=False)
    signature = {n: 'constexpr' if n in constexprs else _POINTERS.get(n, 'i32') for n in names}
    attrs = {(names.index(n),): [['tt.divisibility', 16]] for n in names if n in _POINTERS or n in divisible}
    kernel = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=GPUTarget('cuda', 90, 32),
                            options=dict(num_warps=4))
    ptx = kernel.asm['ptx']
    ops = re.findall(r'\b(?:st|ld)\.global[.\w]*', ptx)   # predicated or not (`@%p1 st.global...`)
    return Counter(op for op in ops if op.startswith('st.')), Counter(op for op in ops if op.startswith('ld.'))


def test_aligned_conv_stores_are_vectors():
    plain_stores, plain_loads = global_memory_ops(False)
    vector_stores, vector_loads = global_memory_ops(True)
    assert set(plain_stores) == {'st.global.b16'}, plain_stores          # element by element
    assert vector_stores['st.global.v4.b32'] >= 1, vector_stores        # the one-plane branch: 8 bf16 a store
    assert vector_stores['st.global.b16'] == plain_stores['st.global.b16']   # the general branch, unchanged
    assert vector_loads == plain_loads                                     # the input side is the same kernel
    assert plain_loads['ld.global.v4.b32'] >= 1                            # the token rows load as vectors


def test_aligned_conv_stores_are_vectors_for_bounds_of_eight():
    """Token counts, channel counts and plane bounds that are multiples of 8 but not of 16 (which Triton does not
    specialize on): only the kernel's alignment hints tell the compiler the one-plane offsets are 16-byte runs."""
    plain_stores, _ = global_memory_ops(False, divisible=('stride_xt', 'stride_s0'))
    vector_stores, _ = global_memory_ops(True, divisible=('stride_xt', 'stride_s0'))
    assert set(plain_stores) == {'st.global.b16'}, plain_stores
    assert vector_stores['st.global.v4.b32'] >= 1, vector_stores
