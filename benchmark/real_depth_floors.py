"""Device floors of `bench_real_depth.py`: what one forward must move and compute, from the model config alone, and
the H200's measured copy bandwidth and bf16 matmul rate.

Parameters are counted per layer from the config fields (the same formulas as transformers' Qwen3.5 / Qwen3-Next
modules; the CPU test checks the totals against the parameters of the transformers model built from the config):
- full attention: q (with its output gate: 2 * heads * head_dim), k, v, o projections, q/k norms;
- gated DeltaNet: the q, k, v, z, b, a input projections, the depthwise conv, A_log, dt_bias, gated norm, out_proj;
- dense MLP 3 * hidden * intermediate, or MoE: router, `num_experts` experts of 3 * hidden * moe_intermediate,
  the shared expert and its gate;
- embedding, lm_head (untied), two norms per layer and the final norm.

Floors (stated beside every figure in the report):
- decode step at batch B with C context tokens per sequence: bytes = the non-expert weights (all but the embedding
  table, of which B rows) + the experts the batch touches (expected distinct experts of B * top_k uniform draws:
  E * (1 - (1 - k / E) ** B) per MoE layer) + KV read (B * C * KV bytes per token) + the recurrent state read and
  written (2 * B * state bytes per sequence); time = max(bytes / bandwidth, FLOPs / matmul rate); tok/s = B / time.
- prefill of T tokens after P cached: FLOPs = 2 * active matmul params * T (experts: top_k of them) + 2 * hidden *
  vocab (one token's logits) + attention 4 * heads * head_dim * sum_{i=1..T}(P + i) per full-attention layer + the
  gated delta rule 4 * dk * dv + 2 * 64 * (dk + dv) per token and value head (chunk 64); bytes = the weights the T
  tokens touch + KV written (T tokens) and read (P tokens) + the state read and written once; time =
  max(FLOPs / matmul rate, bytes / bandwidth).
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

FULL, LINEAR = 'full_attention', 'linear_attention'
GDN_CHUNK = 64


@dataclass(frozen=True)
class ModelCost:
    """Per-model counts that every floor is built from; params are element counts, bytes use `weight_bytes`."""
    num_full_layers: int
    num_linear_layers: int
    num_moe_layers: int
    hidden: int
    vocab: int
    embed_params: int            # the embedding table (read B rows per step, not all of it)
    lm_head_params: int          # 0 when tied
    dense_matmul_params: int     # projections every token multiplies (attention, DeltaNet, dense MLP, shared expert)
    other_params: int            # norms, conv, A_log, dt_bias: read, not multiplied
    expert_params: int           # one routed expert of one layer
    num_experts: int
    top_k: int
    heads: int
    head_dim: int
    linear_v_heads: int
    linear_k_dim: int
    linear_v_dim: int
    kv_bytes_per_token: int      # full-attention K and V of one token over all layers
    state_bytes_per_seq: int     # recurrent + conv state of one sequence over all DeltaNet layers
    weight_bytes: int            # bytes per weight element

    @property
    def total_params(self) -> int:
        return (self.embed_params + self.lm_head_params + self.dense_matmul_params + self.other_params
                + self.num_moe_layers * self.num_experts * self.expert_params)

    def expected_experts(self, tokens: int) -> float:
        """Expected distinct experts of one MoE layer that `tokens` tokens route to (top_k distinct, uniform)."""
        if not self.num_experts:
            return 0.0
        return self.num_experts * (1.0 - (1.0 - self.top_k / self.num_experts) ** tokens)

    def weight_bytes_touched(self, tokens: int) -> float:
        """Weight bytes a forward over `tokens` tokens reads: all but the embedding table, the experts touched."""
        params = (self.lm_head_params + self.dense_matmul_params + self.other_params + tokens * self.hidden
                  + self.num_moe_layers * self.expected_experts(tokens) * self.expert_params)
        return params * self.weight_bytes

    def active_matmul_params(self) -> int:
        return self.dense_matmul_params + self.num_moe_layers * self.top_k * self.expert_params

    def prefill_flops(self, tokens: int, cached: int = 0) -> float:
        attended = tokens * cached + tokens * (tokens + 1) / 2  # sum over new tokens of the keys each attends to
        attention = self.num_full_layers * 4 * self.heads * self.head_dim * attended
        dk, dv = self.linear_k_dim, self.linear_v_dim
        gdn_per_tok = 4 * dk * dv + 2 * GDN_CHUNK * (dk + dv)
        recurrent = self.num_linear_layers * self.linear_v_heads * gdn_per_tok * tokens
        return 2.0 * self.active_matmul_params() * tokens + 2.0 * self.hidden * self.vocab + attention + recurrent

    def prefill_bytes(self, tokens: int, cached: int = 0) -> float:
        return (self.weight_bytes_touched(tokens) + (tokens + cached) * self.kv_bytes_per_token
                + 2 * self.state_bytes_per_seq)

    def prefill_phases(self, tokens: int, cached: int = 0) -> dict[str, tuple[float, float]]:
        """`prefill_flops` and `prefill_bytes` split by the phase that does them, (FLOPs, bytes) each: the routed
        experts, the dense projections (shared expert and router included), the LM head with the embedding rows,
        attention (its KV), the gated delta rule (its state, and the conv / norm weights). A forward runs these one
        after another, each bound by its own resource, so the sum of their floors (`sequential_time_s`) is what
        kernels at their own floors could reach without overlapping phases; the whole-forward floor is lower."""
        wb = self.weight_bytes
        attended = tokens * cached + tokens * (tokens + 1) / 2
        dk, dv = self.linear_k_dim, self.linear_v_dim
        gdn_per_tok = 4 * dk * dv + 2 * GDN_CHUNK * (dk + dv)
        return {
            'experts': (2.0 * self.num_moe_layers * self.top_k * self.expert_params * tokens,
                        self.num_moe_layers * self.expected_experts(tokens) * self.expert_params * wb),
            'dense': (2.0 * self.dense_matmul_params * tokens, self.dense_matmul_params * wb),
            'lm_head': (2.0 * self.hidden * self.vocab, (self.lm_head_params + tokens * self.hidden) * wb),
            'attention': (self.num_full_layers * 4 * self.heads * self.head_dim * attended,
                          (tokens + cached) * self.kv_bytes_per_token),
            'gated_delta_rule': (self.num_linear_layers * self.linear_v_heads * gdn_per_tok * tokens,
                                 2 * self.state_bytes_per_seq + self.other_params * wb),
        }

    def decode_bytes(self, batch: int, context: int, weights_only: bool = False) -> float:
        weights = self.weight_bytes_touched(batch)
        if weights_only:
            return weights
        return weights + batch * (context + 1) * self.kv_bytes_per_token + 2 * batch * self.state_bytes_per_seq


def _get(cfg, name: str, default=None):
    value = getattr(cfg, name, None)
    return default if value is None else value


def _layer_types(cfg) -> list[str]:
    types = _get(cfg, 'layer_types')
    if types:
        return list(types)
    interval = _get(cfg, 'full_attention_interval', 4)
    return [FULL if (i + 1) % interval == 0 else LINEAR for i in range(cfg.num_hidden_layers)]


def _is_moe_layer(cfg, index: int) -> bool:
    if not _get(cfg, 'num_experts', 0):
        return False
    if index in (_get(cfg, 'mlp_only_layers', []) or []):
        return False
    step = _get(cfg, 'decoder_sparse_step', 1)
    return (index + 1) % step == 0


def model_cost(cfg, weight_bytes: int = 2, state_bytes: int = 4) -> ModelCost:
    """Counts from a transformers config (Qwen3.5 dense / MoE text, Qwen3-Next); `state_bytes`: the engine's
    recurrent state dtype (float32 by default)."""
    h, heads, kv_heads, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    nk, nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv, kernel = cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.linear_conv_kernel_dim
    conv_dim = 2 * nk * dk + nv * dv
    types = _layer_types(cfg)
    num_experts = _get(cfg, 'num_experts', 0)
    dense = other = moe_layers = 0
    for i, kind in enumerate(types):
        other += 2 * h  # input and post-attention norms
        if kind == FULL:
            dense += h * 2 * heads * hd + 2 * h * kv_heads * hd + heads * hd * h
            other += 2 * hd
        else:
            dense += h * (conv_dim + nv * dv + 2 * nv) + nv * dv * h
            other += conv_dim * kernel + 2 * nv + dv
        if _is_moe_layer(cfg, i):
            moe_layers += 1
            shared = _get(cfg, 'shared_expert_intermediate_size', 0)
            dense += h * num_experts + 3 * h * shared + (h if shared else 0)
        else:
            dense += 3 * h * cfg.intermediate_size
    other += h  # final norm
    num_full = types.count(FULL)
    num_linear = len(types) - num_full
    vocab = cfg.vocab_size
    tied = bool(_get(cfg, 'tie_word_embeddings', False))
    return ModelCost(
        num_full_layers=num_full, num_linear_layers=num_linear, num_moe_layers=moe_layers, hidden=h, vocab=vocab,
        embed_params=vocab * h, lm_head_params=0 if tied else vocab * h, dense_matmul_params=dense,
        other_params=other, expert_params=3 * h * _get(cfg, 'moe_intermediate_size', 0) if moe_layers else 0,
        num_experts=num_experts if moe_layers else 0, top_k=_get(cfg, 'num_experts_per_tok', 0) if moe_layers else 0,
        heads=heads, head_dim=hd, linear_v_heads=nv, linear_k_dim=dk, linear_v_dim=dv,
        kv_bytes_per_token=num_full * 2 * kv_heads * hd * weight_bytes,
        state_bytes_per_seq=num_linear * (nv * dk * dv * state_bytes + conv_dim * (kernel - 1) * weight_bytes),
        weight_bytes=weight_bytes)


# ----------------------------------------------------------------------------------------------------------------
# the device
# ----------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DeviceRates:
    """Measured at the start of the run: D2D copy (bytes read + written per second) and torch.mm FLOP/s."""
    copy_bytes_per_s: float
    matmul_flops_per_s: float
    how: str

    def time_s(self, flops: float, bytes_: float) -> float:
        return max(flops / self.matmul_flops_per_s, bytes_ / self.copy_bytes_per_s)

    def sequential_time_s(self, phases: dict[str, tuple[float, float]]) -> float:
        """The sum of each phase's own floor (`ModelCost.prefill_phases`)."""
        return sum(self.time_s(flops, bytes_) for flops, bytes_ in phases.values())


def _median_time(fn, device: torch.device, iters: int) -> float:
    def sync():
        if device.type == 'cuda':
            torch.cuda.synchronize()
    fn()
    sync()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _copy_rate(device: torch.device, dtype: torch.dtype, nbytes: int, iters: int) -> float:
    src = torch.empty(nbytes // torch.empty((), dtype=dtype).element_size(), dtype=dtype, device=device).uniform_()
    dst = torch.empty_like(src)
    return 2 * src.numel() * src.element_size() / _median_time(lambda: dst.copy_(src), device, iters)


def _mm_rate(device: torch.device, dtype: torch.dtype, n: int, iters: int) -> float:
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    return 2 * n**3 / _median_time(lambda: torch.mm(a, b), device, iters)


def measure_device(device: torch.device, dtype: torch.dtype, copy_mib: int = 2048, mm_size: int = 8192,
                   iters: int = 10) -> DeviceRates:
    """`dst.copy_(src)` of `copy_mib` MiB (2x the bytes moved) and `torch.mm` of two mm_size^2 matrices."""
    copy_rate = _copy_rate(device, dtype, copy_mib * 2**20, iters)
    mm_rate = _mm_rate(device, dtype, mm_size, iters)
    how = (f'copy: dst.copy_(src) of {copy_mib} MiB {str(dtype).removeprefix("torch.")}, 2 x bytes / time, median of '
           f'{iters}; matmul: torch.mm {mm_size}x{mm_size}x{mm_size}, 2*n^3 / time, median of {iters}')
    return DeviceRates(copy_bytes_per_s=copy_rate, matmul_flops_per_s=mm_rate, how=how)
