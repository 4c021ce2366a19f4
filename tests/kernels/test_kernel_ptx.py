"""Properties of our Triton kernels read in the PTX Triton compiles for Hopper (sm90), offline: no GPU is needed,
only Triton's CUDA backend, which its wheel carries. Compiled with the specialization the model shapes get
(pointers 16-byte aligned; the ints named divisible by 16; unit strides the constant 1).

- The conv's stores (`causal_conv1d._conv_tokens_kernel`): through the per-column plane layout, whose offsets hide
  their alignment from the compiler, element by element (`st.global.b16`), the suspected cause of the kernel's 3.8x
  its copy floor (H100 run 73, `docs/benchmarks.md`); with ALIGNED (`LMDEPLOY_CONV_VECTOR_STORES=1`, channels and
  plane bounds multiples of 8) a channel block inside one plane stores 16-byte vectors, also where those counts
  are multiples of 8 but not of 16 (only the kernel's hints tell the compiler then).
- The few-token MoE's down launch (`moe_gemv._moe_gemv_down_kernel`): its top-k loop unrolled with the shared
  expert's pointer chosen by a select, so the pairs' reduction loops follow one another with no branch between them.
- The prefill MoE's expert GEMMs (`moe._moe_up_kernel` / `_moe_down_kernel`, and the block-wise FP8 ones) at the
  tiles that run wgmma: ptxas (the one Triton carries, run on the PTX with `-v`) reports no serialized wgmma
  (warning C7514, which it gives when a non-wgmma instruction reads a wgmma accumulator inside the pipeline: every
  wgmma of the K loop then waits for the one before).
"""
from __future__ import annotations

import glob
import json
import os
import re
import subprocess
from collections import Counter

import pytest

triton = pytest.importorskip('triton')

from lmdeploy.pytorch.kernels.cuda import blocked_fp8_moe, causal_conv1d, moe, moe_gemv  # noqa: E402

_CONV_POINTERS = {'x_ptr': '*bf16', 'w_ptr': '*bf16', 'bias_ptr': '*bf16', 'state_ptr': '*bf16', 'out_ptr': '*bf16',
             'seq_of_token_ptr': '*i64', 'cu_seqlens_ptr': '*i64', 'state_ids_ptr': '*i64', 'fresh_ptr': '*u8'}
_CONV_DIVISIBLE = ('num_tokens', 'channels', 'stride_xt', 'stride_s0', 'bound1', 'bound2', 'bound3')


def sm90_ptx(kernel, pointers: dict, constexprs: dict, divisible, num_warps: int, num_stages: int = 3) -> str:
    """The PTX of `kernel` (a `fast_kernel` or a Triton kernel) for sm90: `pointers` name -> Triton pointer type
    (16-byte aligned), the other non-constexpr arguments i32 (`divisible`: those specialized as multiples of 16),
    `constexprs` over the kernel's defaults."""
    return sm90_kernel(kernel, pointers, constexprs, divisible, num_warps, num_stages).asm['ptx']


def sm90_kernel(kernel, pointers: dict, constexprs: dict, divisible, num_warps: int, num_stages: int = 3):
    """`sm90_ptx`'s compiled kernel (its `asm` and `metadata`)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    if 'nvidia' not in getattr(triton.backends, 'backends', {}):
        pytest.skip("this Triton has no CUDA backend")
    fn = kernel if isinstance(kernel, triton.runtime.jit.JITFunction) else kernel.fn   # a `fast_kernel` or not
    if not isinstance(fn, triton.runtime.jit.JITFunction):
        pytest.skip('Triton runs interpreted here')
    names = fn.arg_names
    constexprs = {**{p.name: p.default for p in fn.params if p.is_constexpr}, **constexprs}
    signature = {n: 'constexpr' if n in constexprs else pointers.get(n, 'i32') for n in names}
    attrs = {(names.index(n),): [['tt.divisibility', 16]] for n in names if n in pointers or n in divisible}
    return triton.compile(ASTSource(fn, signature, constexprs, attrs), target=GPUTarget('cuda', 90, 32),
                          options=dict(num_warps=num_warps, num_stages=num_stages))


def global_memory_ops(aligned: bool, divisible=_CONV_DIVISIBLE, history: bool = True) -> tuple[Counter, Counter]:
    """(stores, loads) of the conv kernel's PTX, by instruction form; `history`: its READ_HISTORY."""
    # (unit strides are specialized to the constant 1, as Triton does at launch: the weight's taps, the history's)
    constexprs = dict(stride_wk=1, stride_s2=1, KERNEL=4, HAS_BIAS=False, SILU=True, BLOCK_T=16, BLOCK_C=128,
                      ALIGNED=aligned, READ_HISTORY=history, PDL=False)
    ptx = sm90_ptx(causal_conv1d._conv_tokens_kernel, _CONV_POINTERS, constexprs, divisible, 4)
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


def test_conv_without_history_loads_no_scalar_rows():
    """The history read element by element (its columns at a (K-1)-element channel stride: 16 a thread a tap, all
    predicated, with their 64-bit address arithmetic) is what `SPLIT_HISTORY` takes out of the token-parallel
    kernel; left are the vector loads of the token rows and one weight a thread a tap."""
    _, with_history = global_memory_ops(True)
    _, without = global_memory_ops(True, history=False)
    assert with_history['ld.global.b16'] == 16 * 4 + 4, with_history
    assert without['ld.global.b16'] == 4, without
    assert without['ld.global.v4.b32'] == with_history['ld.global.v4.b32'] >= 4


def test_aligned_conv_stores_are_vectors_for_bounds_of_eight():
    """Token counts, channel counts and plane bounds that are multiples of 8 but not of 16 (which Triton does not
    specialize on): only the kernel's alignment hints tell the compiler the one-plane offsets are 16-byte runs."""
    plain_stores, _ = global_memory_ops(False, divisible=('stride_xt', 'stride_s0'))
    vector_stores, _ = global_memory_ops(True, divisible=('stride_xt', 'stride_s0'))
    assert set(plain_stores) == {'st.global.b16'}, plain_stores
    assert vector_stores['st.global.v4.b32'] >= 1, vector_stores


def test_moe_down_launch_runs_one_loop_per_pair_and_no_other_branch():
    bf16 = '*bf16'
    pointers = dict(act_ptr=bf16, w_ptr=bf16, shared_ptr=bf16, ids_ptr='*i64', weights_ptr=bf16, out_ptr=bf16)
    divisible = ('hidden', 'inter', 'stride_at', 'stride_we', 'stride_wn', 'stride_ot')
    shape = dict(TOP_K=9, NUM_EXPERTS=64, HAS_SHARED=True, BLOCK_N=8, BLOCK_K=128, UNROLL=9, PDL=True)  # 35B-A3B
    ptx = sm90_ptx(moe_gemv._moe_gemv_down_kernel, pointers, shape, divisible, 8)
    # each pair's reduction loop: a back edge and an entry test; a branch on the shared expert would add more
    assert 9 <= len(re.findall(r'\bbra\b', ptx)) <= 2 * 9, len(re.findall(r'\bbra\b', ptx))
    assert len(re.findall(r'ld\.global\.v2\.b32', ptx)) == 9 * 2          # one weight and one activation load a pair


def _triton_ptxas() -> str:
    """The ptxas Triton compiles with (its wheel carries one); skips the test where none is found."""
    from triton.backends.nvidia import compiler as nvidia
    for args in ((90,), ()):   # Triton releases differ in whether get_ptxas takes the architecture
        try:
            tool = nvidia.get_ptxas(*args)
        except (TypeError, RuntimeError, AttributeError):
            continue
        path = getattr(tool, 'path', tool)
        if isinstance(path, str) and os.path.isfile(path):
            return path
    path = os.path.join(os.path.dirname(triton.__file__), 'backends', 'nvidia', 'bin', 'ptxas')
    if not os.path.isfile(path):
        pytest.skip('no ptxas in this Triton')
    return path


def ptxas_report(ptx: str, tmp_path) -> str:
    """What ptxas (Triton's own, for sm90a) reports on `ptx` with `-v`: its warnings and resource usage."""
    ptxas = _triton_ptxas()
    src = tmp_path / 'kernel.ptx'
    src.write_text(ptx)
    run = subprocess.run([ptxas, '-arch=sm_90a', '-v', str(src), '-o', str(tmp_path / 'kernel.cubin')],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    return run.stderr


_MOE_POINTERS = {'sorted_pairs_ptr': '*i64', 'block_expert_ptr': '*i64', 'weights_ptr': '*fp32'}
_MOE_DIVISIBLE = ('hidden', 'inter', 'stride_xt', 'stride_at', 'stride_we', 'stride_wn', 'stride_ot')


def assert_moe_wgmma_pipelined(kernel, which: str, pointers: dict, shape: dict, warps: int, stages: int,
                                tmp_path) -> None:
    """An expert GEMM launch (`which`: up / down) built for sm90 runs wgmma, and ptxas does not serialize it (C7514)."""
    if which == 'up':
        shape = {**shape, 'TOP_K': 8}
    ptx = sm90_ptx(kernel, pointers, shape, _MOE_DIVISIBLE, warps, num_stages=stages)
    assert 'wgmma.mma_async' in ptx
    report = ptxas_report(ptx, tmp_path)
    assert 'C7514' not in report, report


@pytest.mark.parametrize('dtype', ['bf16', 'fp16'])
@pytest.mark.parametrize('tiles', [(64, (64, 64, 4, 3)), (128, (128, 64, 8, 3)), (128, (64, 64, 8, 3)),
                                   (128, (128, 64, 8, 4))], ids=lambda t: f'M{t[0]}-N{t[1][0]}-w{t[1][2]}-s{t[1][3]}')
@pytest.mark.parametrize('which', ['up', 'down'])
def test_moe_expert_gemms_keep_their_wgmma_pipelined(which, tiles, dtype, tmp_path):
    """The tuned tables' prefill tiles (35B-A3B experts) and `moe.LARGE_ROWS_CONFIG`'s: the down launch's epilogue
    rounds the accumulator to the output dtype before the routing weight, and read straight from the accumulator
    that rounding serialized the K loop's wgmma (C7514) until `moe.store_routed` passed it through a float32 add
    first (the fp16 up launch's at 128 x 128 likewise, `store_swiglu`)."""
    block_m, (block_n, block_k, warps, stages) = tiles
    kernel = moe._moe_up_kernel if which == 'up' else moe._moe_down_kernel
    pointers = {**_MOE_POINTERS, **{n: f'*{dtype}' for n in ('x_ptr', 'a_ptr', 'w_ptr', 'shared_ptr', 'out_ptr')}}
    shape = dict(NUM_EXPERTS=64, HAS_SHARED=False, PRECISION='tf32', BLOCK_M=block_m, BLOCK_N=block_n,
                 BLOCK_K=block_k, stride_wk=1)
    assert_moe_wgmma_pipelined(kernel, which, pointers, shape, warps, stages, tmp_path)


@pytest.mark.parametrize('rows_per_expert', [100, blocked_fp8_moe.FP8_LARGE_ROWS], ids=['rows100', 'large'])
@pytest.mark.parametrize('which', ['up', 'down'])
def test_fp8_moe_expert_gemms_keep_their_wgmma_pipelined(which, rows_per_expert, tmp_path):
    """The default tiles at BLOCK_M 64, below and from `FP8_LARGE_ROWS` rows an expert."""
    kernel = blocked_fp8_moe._moe_up_fp8_kernel if which == 'up' else blocked_fp8_moe._moe_down_fp8_kernel
    fp8 = '*fp8e4nv'
    pointers = {**_MOE_POINTERS, 'x_ptr': fp8, 'a_ptr': fp8, 'w_ptr': fp8, 'xs_ptr': '*fp32', 'as_ptr': '*fp32',
                'ws_ptr': '*fp32', 'out_ptr': '*bf16'}
    config = blocked_fp8_moe.default_fp8_config(64 * rows_per_expert, 64)
    block_n, warps, stages = config.up if which == 'up' else config.down
    shape = dict(NUM_EXPERTS=64, BLOCK_SIZE_N=128, BLOCK_M=config.block_m, BLOCK_N=block_n, BLOCK_K=128)
    assert_moe_wgmma_pipelined(kernel, which, pointers, shape, warps, stages, tmp_path)


# The most dynamic shared memory one block may take on Hopper (H100 / H200): 227 KiB.
_SM90_SHARED_BYTES = 227 * 1024


def moe_configs_of(half: bool) -> set:
    """Every tile config `moe.default_config` hands a call in half precision (`half`) or float32: the shipped
    tables (for their devices), the large tiles and the untuned ones, over pair counts and expert counts."""
    configs = set()
    for path in glob.glob(os.path.join(os.path.dirname(moe.__file__), 'moe_configs', '*.json')):
        with open(path) as f:
            device = json.load(f)['device']
        for pairs in (1, 8, 100, 1000, 10 ** 4, 10 ** 5, 10 ** 6):
            configs.add(moe.default_config(pairs, 64, 2048, 512, device, half))
    for experts in (8, 64, 256, 512):
        for rows in (1, 16, 40, 100, 255, 256, 4096):
            configs.add(moe.default_config(rows * experts, experts, half=half))
    return configs


@pytest.mark.parametrize('half', [True, False], ids=['bf16', 'fp32'])
def test_every_moe_config_fits_shared_memory(half):
    """What a call can pick compiles within a Hopper block's shared memory in its dtype (a float32 call on the
    half-precision tables' or large tiles would need up to 288 KiB: `default_config(half=False)`)."""
    dtype, precision = ('bf16', 'tf32') if half else ('fp32', 'ieee')
    pointers = {**_MOE_POINTERS, **{n: f'*{dtype}' for n in ('x_ptr', 'a_ptr', 'w_ptr', 'shared_ptr', 'out_ptr')}}
    for config in moe_configs_of(half):
        for kernel, (block_n, block_k, warps, stages) in ((moe._moe_up_kernel, config.up),
                                                          (moe._moe_down_kernel, config.down)):
            shape = dict(NUM_EXPERTS=64, HAS_SHARED=False, PRECISION=precision, BLOCK_M=config.block_m,
                         BLOCK_N=block_n, BLOCK_K=block_k, TOP_K=8, stride_wk=1)
            if kernel is moe._moe_down_kernel:
                del shape['TOP_K']
            shared = sm90_kernel(kernel, pointers, shape, _MOE_DIVISIBLE, warps, stages).metadata.shared
            assert shared <= _SM90_SHARED_BYTES, (config, kernel.fn.__name__, shared)
