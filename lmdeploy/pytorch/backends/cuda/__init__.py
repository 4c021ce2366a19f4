"""The `cuda` backend: Triton kernels (and fla-core for the gated delta rule); anything missing falls back to the
`default` backend op by op.

Fused small ops (one launch each): residual add + RMSNorm, the MoE router's softmax + top-k + renormalisation, the
attention layers' rotary + KV fill, and the gated DeltaNet gating (g, beta). `LMDEPLOY_FUSED_OPS=0` (read at
import) builds the unfused sequences instead (same kernels one by one, torch for the adds, the router and the
gating), for before/after measurements.

Fused prefill kernels, on by default (verified on the H200 in runs 6 and 7, 2026-12-01: `docs/benchmarks.md`);
`LMDEPLOY_FUSED_PREFILL=0` (read at import) turns them off: the MLPs' SiLU-and-mul and gated attention's sigmoid
output gate in one pass each (`kernels/cuda/activation.py`; off: torch's pairs), the RMSNorm that reads per-head
rows in place and packs short rows into one program (`kernels/cuda/rms_norm_rows.py`; off: `rms_norm.py`, which
copies z), and the gated DeltaNet conv writing q / k / v as contiguous tensors (`causal_conv1d_planes`; off: views
of one [T, C] output, which fla's input guard copies). Off, the CUDA path runs the kernels verified at 3d77198.

Linears of one half-precision row (batch-1 decode, one sequence's logits) run the Triton GEMV of
`kernels/cuda/gemv.py`, which reads the weights faster than cuBLAS at one row on the H200 (run 34:
`benchmark/bench_decode_gemms.py`); `LMDEPLOY_TRITON_GEMV=0` (read at import) keeps cuBLAS for them. A norm and
the one-row linear that reads it (`OpType.RMSNormLinear`: a decode layer's input and post-attention norms with the
projection after each) can run as one launch, the GEMV with the norm in its prologue (`gemv.norm_gemv`), with
`LMDEPLOY_NORM_GEMV=1` (read at import; off by default: on the H200 the fused GEMV lost more than the norm launch
cost, run 45). A MoE layer's post-attention norm, its router's GEMV and the top-k routing can run as one launch
for a few tokens (`OpType.NormRoute`, `kernels/cuda/moe_routing.norm_route`), and the gated DeltaNet output norm
inside the recurrent pool kernel (`out_norm`), with `LMDEPLOY_NORM_ROUTE=1` / `LMDEPLOY_FOLD_OUT_NORM=1` (read at
import; off by default: neither beat the launches it saves on the H100, runs 47-48).
"""
from __future__ import annotations

import functools
import inspect
import logging
import os

import torch
import torch.nn.functional as F

from ...kernels.cuda import blocked_fp8 as _fp8
from ...kernels.cuda import causal_conv1d as _conv
from ...kernels.cuda import gated_delta_rule as _gdr
from ...kernels.cuda import moe as _moe
from ...kernels.cuda import rms_norm_rows as _norm_rows
from ...kernels.cuda.activation import sigmoid_gate_mul, silu_and_mul
from ...kernels.cuda.blocked_fp8_moe import fused_moe_blocked_fp8
from ...kernels.cuda.blocked_fp8_moe import warm_up_tiles as warm_up_fp8_moe_tiles  # noqa: F401 (tune_kernels)
from ...kernels.cuda.copy_packed_cache import copy_packed_cache, copy_state_slots
from ...kernels.cuda.fill_kv_cache import fill_kv_cache
from ...kernels.cuda.fused_recurrent_gated_delta import fused_recurrent_gated_delta_rule, out_norm_supported
from ...kernels.cuda.gated_delta_gating import gated_delta_gating
from ...kernels.cuda.gathered_prefill_attention import gathered_prefill_attention, use_gathered_prefill
from ...kernels.cuda.gemv import gemv, norm_gemv
from ...kernels.cuda.lora import sgmv_lora
from ...kernels.cuda.moe import fused_moe
from ...kernels.cuda.moe import warm_up_tiles as warm_up_moe_tiles  # noqa: F401 (ModelAgent.tune_kernels)
from ...kernels.cuda.moe_gemv import MAX_TOKENS as MOE_GEMV_MAX_TOKENS
from ...kernels.cuda.moe_routing import norm_route as _norm_route
from ...kernels.cuda.moe_routing import norm_route_supported, softmax_topk
from ...kernels.cuda.paged_attention import paged_decode_attention
from ...kernels.cuda.paged_prefill_attention import paged_prefill_attention
from ...kernels.cuda.rms_norm import add_rms_norm, gated_rms_norm, rms_norm
from ...kernels.cuda.rotary import apply_rotary, rotary_fill_kv_cache
from ...kernels.cuda.varlen_attention import varlen_attention
from ...model_inputs import upload_index_tensors
from ..base import Backend, OpType
from ..default import BACKEND as DEFAULT_BACKEND
from ..default import blocked_fp8_builder, gated_delta_rule_builder
from ..default.elementwise import gated_delta_gating as default_gated_delta_gating
from ..default.elementwise import norm_then_linear
from ..default.elementwise import sigmoid_gate_mul as default_sigmoid_gate_mul
from ..default.elementwise import silu_and_mul as default_silu_and_mul
from ..default.moe import norm_then_route
from ..default.moe import softmax_topk as default_softmax_topk

_FUSED_OPS = os.environ.get('LMDEPLOY_FUSED_OPS', '1') != '0'
_TRITON_GEMV = os.environ.get('LMDEPLOY_TRITON_GEMV', '1') != '0'
# the norm in the GEMV's prologue: opt-in, slower than the two launches on the H200 (run 45, docs/benchmarks.md)
_NORM_GEMV = _TRITON_GEMV and os.environ.get('LMDEPLOY_NORM_GEMV', '0') == '1'
# the decode gating inside the pool kernel (the fused gating kernel's code, so _FUSED_OPS too; H200 run 45: gpu
# tests passed, decode within noise of the two launches); LMDEPLOY_FOLD_GATING=0 keeps the separate launch
_FOLD_GATING = _FUSED_OPS and os.environ.get('LMDEPLOY_FOLD_GATING', '1') != '0'
# the gated DeltaNet output norm inside the pool kernel too, where it folds the gating (decode): opt-in with
# LMDEPLOY_FOLD_OUT_NORM=1, slower than the norm's own launch on the H100 (runs 47-48, docs/benchmarks.md)
_FOLD_OUT_NORM = _FOLD_GATING and os.environ.get('LMDEPLOY_FOLD_OUT_NORM', '0') == '1'
# a MoE layer's norm, router GEMV and top-k in one launch for a few tokens (`kernels/cuda/moe_routing.norm_route`):
# opt-in with LMDEPLOY_NORM_ROUTE=1 (H100 run 47: its first form was slower than the three launches)
_NORM_ROUTE = _FUSED_OPS and os.environ.get('LMDEPLOY_NORM_ROUTE', '0') == '1'


def fused_prefill_enabled() -> bool:
    """The fused prefill kernels (module docstring) unless `LMDEPLOY_FUSED_PREFILL=0`; the backend asks once,
    at import (`_FUSED_PREFILL`)."""
    return os.environ.get('LMDEPLOY_FUSED_PREFILL', '1') != '0'


_FUSED_PREFILL = fused_prefill_enabled()


def _prefill_attention_mode() -> str:
    """Long eager prefill chunks (`LMDEPLOY_PREFILL_ATTN`, read at import): `paged` = the Triton kernel on the
    pool, `gathered` = K/V gathered from the pool + torch SDPA's flash kernel
    (`kernels/cuda/gathered_prefill_attention.py`)."""
    mode = os.environ.get('LMDEPLOY_PREFILL_ATTN', 'paged')
    if mode not in ('paged', 'gathered'):
        raise ValueError(f"LMDEPLOY_PREFILL_ATTN must be 'paged' or 'gathered', got {mode!r}")
    return mode


_GATHERED_PREFILL = _prefill_attention_mode() == 'gathered'
_sigmoid_gate_mul = sigmoid_gate_mul if _FUSED_PREFILL else default_sigmoid_gate_mul


def _const(fn):
    def build(**_kwargs):
        return fn
    return build


def _build_attention(**_kwargs):
    def forward(q, k, v, k_cache, v_cache, inputs, scale, cos_sin=None, qk_norm=None, output_gate=None):
        out = _attend(q, k, v, k_cache, v_cache, inputs, scale, cos_sin, qk_norm, output_gate)
        if output_gate is not None and not inputs.is_decode:  # decode: inside the merge launch
            out = _sigmoid_gate_mul(out, output_gate)
        return out
    return forward


def _attend(q, k, v, k_cache, v_cache, inputs, scale, cos_sin, qk_norm, output_gate):
    """`_build_attention`'s op before a prefill's output gate (a decode's runs in its merge launch)."""
    if cos_sin is not None and _FUSED_OPS:  # one launch: q/k norm, rotary, and K / V straight into the pool
        q = rotary_fill_kv_cache(q, k, v, *cos_sin, k_cache, v_cache, inputs.slot_mapping, qk_norm=qk_norm)
    else:
        if qk_norm is not None:
            q = rms_norm(q, qk_norm.q_weight, qk_norm.eps, qk_norm.zero_centered)
            k = rms_norm(k, qk_norm.k_weight, qk_norm.eps, qk_norm.zero_centered)
        if cos_sin is not None:
            q, k = apply_rotary(q, k, *cos_sin)
        fill_kv_cache(k, v, k_cache, v_cache, inputs.slot_mapping)
    if inputs.is_decode:
        return paged_decode_attention(q, k_cache, v_cache, inputs.block_tables, inputs.kv_lens, scale,
                                      gate=output_gate)
    if _GATHERED_PREFILL and use_gathered_prefill(inputs.q_lens_list, inputs.host_lens_exact):
        return gathered_prefill_attention(q, k_cache, v_cache, inputs.block_tables, inputs.q_lens_list,
                                          inputs.kv_lens_list, scale)
    return paged_prefill_attention(q, k_cache, v_cache, inputs.block_tables, inputs.cu_seqlens_q,
                                   inputs.q_lens, inputs.kv_lens, inputs.max_seqlen_q, scale)


def _unfused_add_rms_norm(x, residual, weight, eps, zero_centered=False):
    new_residual = x + residual
    return rms_norm(new_residual, weight, eps, zero_centered), new_residual


def _build_vision_attention(**_kwargs):
    def forward(q, k, v, cu_seqlens, cu_seqlens_list, max_seqlen, scale):
        return varlen_attention(q, k, v, cu_seqlens, max_seqlen, scale)
    return forward


def _fla_available() -> bool:
    try:
        import fla  # noqa: F401
        return True
    except ImportError:
        return False


@functools.cache
def fla_takes_chunk_indices() -> bool:
    """Whether the installed fla-core's chunked gated delta rule takes precomputed `chunk_indices` (fla-core 0.6.0
    on). Older releases take the keyword into `**kwargs` and drop it: they derive the indices from `cu_seqlens` on
    the device and read a length back to the host, once per forward, which no CUDA graph can capture (H100 runs
    58-60 with fla-core 0.5.2: every hybrid prefill capture failed)."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    return 'chunk_indices' in inspect.signature(chunk_gated_delta_rule).parameters


def prefill_graphs_supported(dtype: torch.dtype, is_hybrid: bool) -> bool:
    """Whether prefills replay CUDA graphs too (decode graphs are for every model). Hybrids need fla-core in bf16 /
    fp16: a prefill graph runs fla's chunked gated delta rule on padded static chunk indices (`graph_gdr_chunked`,
    which needs an fla-core that takes them: `fla_takes_chunk_indices`, else a warning and eager prefills; or its
    token-by-token kernel, one launch). The float32 gated delta rule is the exact torch kernels, whose chunked form
    loops over the sequences by their host lengths and whose token-by-token form is a per-token loop of small ops:
    neither can replay on other lengths (or would make capture slow and replay no faster), so those hybrids keep
    eager prefills."""
    if not is_hybrid:
        return True
    if dtype == torch.float32 or not _fla_available():
        return False
    if graph_gdr_chunked() and not fla_takes_chunk_indices():
        logging.getLogger('lmdeploy').warning(
            'fla-core %s drops precomputed chunk indices (fla-core >= 0.6.0 takes them): hybrid prefills run eagerly, '
            'each synchronising with the host once; install fla-core>=0.6.0 (the cuda extra) for prefill CUDA graphs',
            fla_version())
        return False
    return True


def fla_version() -> str:
    """The installed fla-core's version, for messages."""
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version('fla-core')
    except PackageNotFoundError:
        return '(version unknown)'


# Prefill graphs run fla's chunked kernels (as eager prefills do) unless LMDEPLOY_GRAPH_GDR=recurrent (the
# token-by-token kernel: one launch, but it walks the tokens of a long prefill one by one).
DEFAULT_GRAPH_GDR = 'chunked'


def graph_gdr_chunked() -> bool:
    """Whether prefill graphs run the chunked gated delta rule (static padded chunk indices,
    `LMDEPLOY_GRAPH_GDR=chunked`) or the token-by-token one (`recurrent`); `DEFAULT_GRAPH_GDR` unless set. Read
    once per engine."""
    mode = os.environ.get('LMDEPLOY_GRAPH_GDR', DEFAULT_GRAPH_GDR)
    if mode not in ('chunked', 'recurrent'):
        raise ValueError(f"LMDEPLOY_GRAPH_GDR must be 'chunked' or 'recurrent', got {mode!r}")
    return mode == 'chunked'


# Index tensors a captured prefill graph derives from its static inputs (the conv's token -> sequence map, fla's
# chunk offsets) built once per capture and shared by its layers, instead of in every gated DeltaNet layer (seven
# launches a layer): the default since H100 run 49 of 2026-12-07 (its gpu tests passed; the 9B's suffix rows 0.1-0.4
# ms faster); `LMDEPLOY_GRAPH_INDEX_ONCE=0` (read at import) builds them in every layer.
_INDEX_ONCE = os.environ.get('LMDEPLOY_GRAPH_INDEX_ONCE', '1') != '0'


def forward_memo(inputs, device: torch.device, key, build):
    """`inputs.derived(key, build)` for tensors on `device`: built once per forward, shared by its layers. A CUDA
    graph capture builds its own copy (inside the graph, at the first layer that asks), never the one an eager run
    on the same inputs built (the capture's warm-up: the graph would replay it stale). With
    `LMDEPLOY_GRAPH_INDEX_ONCE=0` a capture builds it at every call."""
    capturing = device.type == 'cuda' and torch.cuda.is_current_stream_capturing()
    if capturing and not _INDEX_ONCE:
        return build()
    return inputs.derived((key, capturing), build)


def _fla_chunk_kwargs(inputs, device: torch.device) -> dict:
    """fla's chunk indices of this forward's sequences, built on the host once per forward and uploaded without a
    stream synchronisation (fla would derive them on the device and read a length sum back). In a CUDA graph they
    are the static, padded indices the graph runner fills, next to a static ``cu_seqlens``, which fla gets as a
    view made once per forward (`kernels/cuda/gated_delta_rule.py`: fla memoises its chunk offsets by the tensor
    object)."""
    if inputs.graph_chunk_indices is not None:
        return {'chunk_indices': inputs.graph_chunk_indices,
                'cu_seqlens_view': forward_memo(inputs, device, 'fla_cu_seqlens', lambda: inputs.cu_seqlens_q.view(-1))}
    return {'chunk_indices': inputs.derived(('fla_chunk_indices', device), lambda: upload_index_tensors(
        {'i': _gdr.chunk_indices_host(inputs.q_lens_list)}, device)['i'])}


def _recurrent_mode() -> str:
    """The token-by-token gated delta rule of bf16 / fp16 decode and verify forwards (`LMDEPLOY_GDR_RECURRENT`,
    read at import): `pool` = `kernels/cuda/fused_recurrent_gated_delta.py` on the state pool in place (verify
    cuts included), `fla` = fla's fused recurrent kernel on gathered states (verify: one decode call per token),
    for before/after measurements."""
    mode = os.environ.get('LMDEPLOY_GDR_RECURRENT', 'pool')
    if mode not in ('pool', 'fla'):
        raise ValueError(f"LMDEPLOY_GDR_RECURRENT must be 'pool' or 'fla', got {mode!r}")
    return mode


_GDR_RECURRENT = _recurrent_mode()


def _build_gated_delta_rule(**kwargs):
    default = DEFAULT_BACKEND.build(OpType.GatedDeltaRule, **kwargs)
    if not _fla_available():  # fla-core is the `cuda` extra; without it the torch kernels still run on the GPU
        return default
    pool = _GDR_RECURRENT == 'pool'
    fla = gated_delta_rule_builder(_gdr.chunk_gated_delta_rule,
                                   fused_recurrent_gated_delta_rule if pool else _gdr.recurrent_gated_delta_rule,
                                   chunk_kwargs=_fla_chunk_kwargs)(**kwargs)

    def forward(q, k, v, g, beta, state, inputs, use_qk_l2norm=True):
        # fla computes float32 inputs with TF32 matmuls (~1e-2 off); float32 serving is for exactness, so it keeps
        # the exact torch kernels. bf16 / fp16 take fla (chunked) and the pool kernel (token by token).
        impl = default if q.dtype == torch.float32 else fla
        return impl(q, k, v, g, beta, state, inputs, use_qk_l2norm=use_qk_l2norm)

    def draft_cuts(q, k, v, g, beta, state, inputs, use_qk_l2norm=True):
        """A verify forward with its draft cuts in one launch (`nn/draft_cuts.py`), or None: the caller runs one
        decode call per token."""
        if not pool or q.dtype == torch.float32:
            return None
        return fused_recurrent_gated_delta_rule(q, k, v, g, beta, inputs.cu_seqlens_q, state, inputs.state_ids,
                                                inputs.is_fresh, use_qk_l2norm=use_qk_l2norm,
                                                cut_slots=inputs.draft_state_slots)
    def with_gating(q, k, v, a, b, A_log, dt_bias, state, inputs, use_qk_l2norm=True, out_norm=None):
        """The pool kernel computing `gated_delta_gating(a, b, A_log, dt_bias)` itself (the gating kernel's code:
        one launch less a layer) and, given `out_norm` (z, weight, eps), the gated output norm of its outputs
        (another launch less, with `LMDEPLOY_FOLD_OUT_NORM=1`), or None where `forward` would not run the pool
        kernel or not fold the norm: the caller gates first and norms last."""
        if not pool or q.dtype == torch.float32 or not (inputs.is_decode or inputs.use_recurrent_kernel):
            return None
        if out_norm is not None and not (_FOLD_OUT_NORM and out_norm[0].stride(-1) == 1
                                         and out_norm_supported(inputs.state_ids.shape[0], v.shape[1])):
            return None
        return fused_recurrent_gated_delta_rule(q, k, v, a, b, inputs.cu_seqlens_q, state, inputs.state_ids,
                                                inputs.is_fresh, use_qk_l2norm=use_qk_l2norm,
                                                gating_params=(A_log, dt_bias), out_norm=out_norm)
    forward.draft_cuts = draft_cuts
    if _FOLD_GATING:
        forward.with_gating = with_gating
    return forward


def _conv_index(inputs, x: torch.Tensor) -> dict:
    """The conv kernel's per-forward index tensors (fresh flags as bytes, each token's sequence), built once per
    forward for every gated DeltaNet layer (`forward_memo`: under CUDA graph capture, inside the graph)."""
    def build() -> dict:
        num_tokens = x.shape[0]
        seq = _conv.seq_of_token_of(inputs.cu_seqlens_q, num_tokens) \
            if num_tokens != inputs.state_ids.shape[0] else None
        return {'fresh_u8': _conv.fresh_flags(inputs.is_fresh, x.device), 'seq_of_token': seq}
    return forward_memo(inputs, x.device, ('conv_index', x.shape[0]), build)


def _build_causal_conv1d(**_kwargs):
    def forward(x, weight, bias, conv_state, inputs, activation='silu', out_splits=None):
        index = _conv_index(inputs, x)
        if out_splits is not None and _FUSED_PREFILL:  # each channel group contiguous: no copy in fla's guard
            return _conv.causal_conv1d_planes(x, weight, bias, conv_state, inputs.state_ids, inputs.is_fresh,
                                              inputs.cu_seqlens_q, out_splits, activation=activation, **index)
        out = _conv.causal_conv1d(x, weight, bias, conv_state, inputs.state_ids, inputs.is_fresh,
                                  inputs.cu_seqlens_q, activation=activation, **index)
        return out if out_splits is None else out.split(list(out_splits), dim=-1)
    return forward


def _build_moe(**_kwargs):
    """`fused_moe`; with its few-token path on (the default; `LMDEPLOY_MOE_GEMV=0` turns it off) its
    `fold_shared_max_tokens` asks `nn.moe.SparseMoeBlock` to fold a shared expert into it for forwards of up to
    `moe_gemv.MAX_TOKENS` tokens (one more pair of its two launches instead of five kernels of its own)."""
    impl = functools.partial(fused_moe)
    impl.fold_shared_max_tokens = MOE_GEMV_MAX_TOKENS if _moe.few_token_path_enabled() else 0
    return impl


def _build_lora(**_kwargs):
    def forward(x, out, lora_a, lora_b, slice_sizes, inputs):
        return sgmv_lora(x, out, lora_a, lora_b, slice_sizes, inputs.lora_ids, inputs.cu_seqlens_q,
                         inputs.max_seqlen_q)
    return forward


def _build_linear_blocked_f8(block_size: tuple[int, int], **_kwargs):
    """Triton FP8 GEMM, or torch's `_scaled_mm` when `LMDEPLOY_FP8_GEMM=torch` and it works here (decided now, at
    construction, so nothing is probed inside a CUDA graph capture)."""
    use_torch = _fp8.use_torch_scaled_mm(block_size)

    def forward(x, weight, weight_scale_inv, bias):
        return _fp8.linear_blocked_fp8(x, weight, weight_scale_inv, bias, block_size, use_torch=use_torch)
    return forward


def tune_fp8_gemms(shapes: set[tuple[int, int, tuple[int, int]]], max_rows: int, dtype: torch.dtype,
                   device: torch.device) -> int:
    """Autotune the Triton FP8 GEMM for these (N, K, block_size) and row counts up to `max_rows` (see
    `kernels/cuda/blocked_fp8.tune_blocked_gemm_fp8`); the number of keys run."""
    return _fp8.tune_blocked_gemm_fp8(shapes, max_rows, dtype, device)


def _one_half_row(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the one-row GEMV kernels take x @ weight^T: one contiguous fp16 / bf16 row, weight of its dtype with
    contiguous rows."""
    return (x.dim() == 2 and x.size(0) == 1 and x.dtype in (torch.float16, torch.bfloat16) and x.is_contiguous()
            and weight.dtype == x.dtype and weight.stride(-1) == 1)


def triton_gemv_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear`, through the one-row GEMV (`kernels/cuda/gemv.py`) for one contiguous half-precision row."""
    if _one_half_row(x, weight) and (bias is None or bias.dtype == x.dtype):
        return gemv(x, weight, bias)
    return F.linear(x, weight, bias)


_rms_norm = _norm_rows.rms_norm if _FUSED_PREFILL else rms_norm
_add_rms_norm = (_norm_rows.add_rms_norm if _FUSED_PREFILL else add_rms_norm) if _FUSED_OPS else _unfused_add_rms_norm
_norm_then_linear = norm_then_linear(_rms_norm, _add_rms_norm, triton_gemv_linear if _TRITON_GEMV else F.linear)


def rms_norm_linear(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                    zero_centered: bool, weight: torch.Tensor, store_normed: bool = False
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """`OpType.RMSNormLinear` (semantics: `default.elementwise.rms_norm_linear`): one launch of `gemv.norm_gemv` for
    one contiguous half-precision row (h only with `store_normed`), else this backend's norm, then its linear."""
    if (_NORM_GEMV and _one_half_row(x, weight) and norm_weight.is_contiguous()
            and (residual is None or (residual.shape == x.shape and residual.dtype == x.dtype
                                      and residual.is_contiguous()))):
        return norm_gemv(x, residual, norm_weight, eps, zero_centered, weight, store_normed=store_normed)
    return _norm_then_linear(x, residual, norm_weight, eps, zero_centered, weight)


_softmax_topk = softmax_topk if _FUSED_OPS else default_softmax_topk
_norm_then_route = norm_then_route(rms_norm_linear, _softmax_topk)


def norm_route(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
               zero_centered: bool, rows: torch.Tensor, top_k: int, renormalize: bool, has_shared: bool
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`OpType.NormRoute` (semantics: `default.moe.norm_then_route`): with `LMDEPLOY_NORM_ROUTE=1` one launch of
    `moe_routing.norm_route` for up to the few-token MoE's tokens, else this backend's norm + linear, then its
    routing."""
    if (_NORM_ROUTE and x.shape[0] <= MOE_GEMV_MAX_TOKENS and norm_route_supported(x, rows)
            and (residual is None or (residual.dtype == x.dtype and residual.stride(-1) == 1))):
        return _norm_route(x, residual, norm_weight, eps, zero_centered, rows, top_k, renormalize, has_shared)
    return _norm_then_route(x, residual, norm_weight, eps, zero_centered, rows, top_k, renormalize, has_shared)


_BUILDERS = {
    OpType.PagedAttention: _build_attention,
    OpType.VisionAttention: _build_vision_attention,
    OpType.CacheBlockCopy: _const(copy_packed_cache),
    OpType.StateSlotCopy: _const(copy_state_slots),
    OpType.RMSNorm: _const(_rms_norm),
    OpType.AddRMSNorm: _const(_add_rms_norm),
    OpType.RMSNormLinear: _const(rms_norm_linear),
    OpType.GatedRMSNorm: _const(_norm_rows.gated_rms_norm if _FUSED_PREFILL else gated_rms_norm),
    OpType.ApplyRotary: _const(apply_rotary),
    OpType.CausalConv1d: _build_causal_conv1d,
    OpType.SiluAndMul: _const(silu_and_mul if _FUSED_PREFILL else default_silu_and_mul),
    OpType.SigmoidGateMul: _const(_sigmoid_gate_mul),
    OpType.GatedDeltaGating: _const(gated_delta_gating if _FUSED_OPS else default_gated_delta_gating),
    OpType.GatedDeltaRule: _build_gated_delta_rule,
    OpType.SoftmaxTopK: _const(_softmax_topk),
    OpType.NormRoute: _const(norm_route),
    OpType.MoE: _build_moe,
    OpType.LinearBlockedF8: _build_linear_blocked_f8,
    OpType.MoEBlockedF8: blocked_fp8_builder(fused_moe_blocked_fp8),
    OpType.LoRA: _build_lora,
}
if _TRITON_GEMV:
    _BUILDERS[OpType.Linear] = _const(triton_gemv_linear)

BACKEND = Backend('cuda', _BUILDERS, parent=DEFAULT_BACKEND)
