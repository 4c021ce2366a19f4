"""Tensor-parallel weight plan: how every parameter of a model splits over `tp` ranks.

A `ShardSpec` names the dimension a parameter splits along and its sections there. Each section is split on its
own (rank r takes the r-th contiguous chunk of every section, concatenated in section order), so fused projections
keep their layout per rank:
- Qwen3.5 / Qwen3-Next gated DeltaNet (internal rows [q, k, v, z], see `qwen3_next.py`): `in_proj_qkvz` splits
  per section [n_k·d_k, n_k·d_k, n_v·d_v, n_v·d_v], `conv1d` per [q, k, v], `in_proj_ba` per [b, a]; `A_log`,
  `dt_bias` chunk by value heads; the gated norm is replicated; `out_proj` is row-parallel (split on its input).
  For Qwen3-Next this equals taking contiguous per-key-head groups of the checkpoint's interleaved rows.
- attention: query sections chunk by head (Qwen3.5 / Qwen3-Next `q_proj` holds [query, gate] per head, so a chunk
  keeps each head's pair); KV sections chunk by KV head, or, with fewer KV heads than ranks, hold the one KV head
  the rank's query heads read (`TPGeometry.kv_head_range`); `o_proj` is row-parallel.
- MLP and MoE split on the intermediate dimension (`gate_up` per [gate, up], `down` row-parallel); the router, the
  shared-expert gate, norms, the embedding and the head are replicated (vocabulary-parallel is not built).
- a row-parallel layer's bias is held by rank 0 only (the all-reduce adds it once).

Every parameter of the model must be named by the plan: an unknown one is an error, never silently replicated.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .tp_geometry import TPGeometry

SPLIT, KV = 'split', 'kv'   # how a section divides: chunk by rank, or by the rank's KV heads


@dataclass(frozen=True)
class ShardSpec:
    """`dim` None: replicated. Otherwise `sections` are (size, how, unit) along `dim`; `how` SPLIT chunks the
    section into `tp` equal parts, KV takes rows of the rank's KV heads (`unit` rows per head)."""
    dim: int | None = None
    sections: tuple[tuple[int, str, int], ...] = ()
    rank0_only: bool = False  # row-parallel bias: rank 0 keeps it, the others hold zeros

    @property
    def replicated(self) -> bool:
        return self.dim is None


REPLICATED = ShardSpec()


def split_spec(size: int, dim: int = 0, parts: int = 1) -> ShardSpec:
    """`parts` equal sections of a `size`-long dimension, each chunked by rank."""
    return ShardSpec(dim, tuple((size // parts, SPLIT, 1) for _ in range(parts)))


def shard_tensor(full: torch.Tensor, spec: ShardSpec, geometry: TPGeometry, rank: int) -> torch.Tensor:
    """Rank `rank`'s part of `full`."""
    if spec.replicated:
        return full.clone()
    if spec.rank0_only:
        return full.clone() if rank == 0 else torch.zeros_like(full)
    total = sum(size for size, _, _ in spec.sections)
    if full.size(spec.dim) != total:
        raise ValueError(f'shape {tuple(full.shape)} has {full.size(spec.dim)} along dim {spec.dim}, the plan '
                         f'{total}')
    parts, start = [], 0
    for size, how, unit in spec.sections:
        if how == SPLIT:
            if size % geometry.tp:
                raise ValueError(f'a section of {size} does not split over tp={geometry.tp}')
            width = size // geometry.tp
            lo, hi = rank * width, (rank + 1) * width
        else:
            head_lo, head_hi = geometry.kv_head_range(rank)
            lo, hi = head_lo * unit, head_hi * unit
        parts.append(full.narrow(spec.dim, start + lo, hi - lo))
        start += size
    return torch.cat(parts, dim=spec.dim).contiguous()


def gather_shards(shards: list[torch.Tensor], spec: ShardSpec, geometry: TPGeometry) -> torch.Tensor:
    """The full tensor from every rank's shard (the inverse of `shard_tensor`); replicated and KV-replicated
    copies must agree, and a row-parallel bias is the sum."""
    if spec.replicated:
        for other in shards[1:]:
            if not torch.equal(other, shards[0]):
                raise ValueError('replicated shards differ between ranks')
        return shards[0]
    if spec.rank0_only:
        return torch.stack(shards).sum(0)
    pieces: list[torch.Tensor] = []
    offsets = [0] * len(shards)
    for size, how, unit in spec.sections:
        if how == SPLIT:
            width = size // geometry.tp
            for r, shard in enumerate(shards):
                pieces.append(shard.narrow(spec.dim, offsets[r], width))
                offsets[r] += width
            continue
        heads = {}
        for r, shard in enumerate(shards):
            lo, hi = geometry.kv_head_range(r)
            part = shard.narrow(spec.dim, offsets[r], (hi - lo) * unit)
            offsets[r] += (hi - lo) * unit
            if lo in heads and not torch.equal(heads[lo], part):
                raise ValueError('replicated KV heads differ between ranks')
            heads[lo] = part
        pieces.extend(heads[h] for h in sorted(heads))
    return torch.cat(pieces, dim=spec.dim)


def _attention_specs(prefix: str, attn: nn.Module, geometry: TPGeometry, gated: bool) -> dict[str, ShardSpec]:
    d = attn.head_dim
    q_unit = 2 * d if gated else d
    qkv = ShardSpec(0, ((attn.num_heads * q_unit, SPLIT, q_unit), (attn.num_kv_heads * d, KV, d),
                        (attn.num_kv_heads * d, KV, d)))
    specs = {f'{prefix}.qkv_proj.weight': qkv, f'{prefix}.qkv_proj.bias': qkv,
             f'{prefix}.o_proj.weight': split_spec(attn.num_heads * d, dim=1),
             f'{prefix}.o_proj.bias': ShardSpec(0, ((1, SPLIT, 1),), rank0_only=True)}
    for norm in ('q_norm', 'k_norm'):
        specs[f'{prefix}.{norm}.weight'] = REPLICATED
    return specs


def _delta_specs(prefix: str, net: nn.Module) -> dict[str, ShardSpec]:
    key_dim, _, value_dim = net.qkv_sizes
    conv = ShardSpec(0, ((key_dim, SPLIT, 1), (key_dim, SPLIT, 1), (value_dim, SPLIT, 1)))
    return {f'{prefix}.in_proj_qkvz.weight': ShardSpec(0, conv.sections + ((value_dim, SPLIT, 1),)),
            f'{prefix}.in_proj_ba.weight': split_spec(2 * net.num_v_heads, parts=2),
            f'{prefix}.conv1d.weight': conv, f'{prefix}.conv1d.bias': conv,
            f'{prefix}.A_log': split_spec(net.num_v_heads), f'{prefix}.dt_bias': split_spec(net.num_v_heads),
            f'{prefix}.norm.weight': REPLICATED,
            f'{prefix}.out_proj.weight': split_spec(value_dim, dim=1)}


def _mlp_specs(prefix: str, mlp: nn.Module) -> dict[str, ShardSpec]:
    inter = mlp.down_proj.weight.size(1)
    return {f'{prefix}.gate_up_proj.weight': split_spec(2 * inter, parts=2),
            f'{prefix}.down_proj.weight': split_spec(inter, dim=1)}


def _experts_specs(prefix: str, experts: nn.Module) -> dict[str, ShardSpec]:
    inter = experts.intermediate_size
    return {f'{prefix}.gate_up_proj': split_spec(2 * inter, dim=1, parts=2),
            f'{prefix}.down_proj': split_spec(inter, dim=2)}


def tp_shard_plan(model: nn.Module, geometry: TPGeometry) -> dict[str, ShardSpec]:
    """`ShardSpec` of every parameter of `model` (a model class of this package, before LoRA is attached);
    `ValueError` naming parameters the plan does not know, or FP8 scales (not sharded yet)."""
    from ..nn.activation import GatedMLP
    from ..nn.moe import FusedExperts
    from .qwen3 import Qwen3Attention
    from .qwen3_next import GatedAttention, GatedDeltaNet
    specs: dict[str, ShardSpec] = {}
    for name, module in model.named_modules():
        if isinstance(module, GatedAttention | Qwen3Attention):
            specs.update(_attention_specs(name, module, geometry, gated=isinstance(module, GatedAttention)))
        elif isinstance(module, GatedDeltaNet):
            specs.update(_delta_specs(name, module))
        elif isinstance(module, GatedMLP):
            specs.update(_mlp_specs(name, module))
        elif isinstance(module, FusedExperts):
            specs.update(_experts_specs(name, module))
    plan, unknown = {}, []
    for name, _ in model.named_parameters():
        if name.endswith('_scale_inv'):
            raise ValueError(f'{name}: FP8 weights are not sharded for tensor parallelism yet')
        if name in specs:
            plan[name] = specs[name]
        elif _replicated_by_name(name):
            plan[name] = REPLICATED
        else:
            unknown.append(name)
    if unknown:
        raise ValueError(f'the tensor-parallel plan does not know {sorted(unknown)[:8]} ({len(unknown)} in all)')
    return plan


_REPLICATED_SUFFIXES = ('layernorm.weight', 'norm.weight', 'embed_tokens.weight', 'lm_head.weight',
                        'gate.weight', 'shared_expert_gate.weight')


def _replicated_by_name(name: str) -> bool:
    """Norms, the embedding, the head, MoE routers and the vision tower (small: replicated on every rank)."""
    return name.endswith(_REPLICATED_SUFFIXES) or name.startswith(('visual.', 'model.visual.'))


def shard_state_dict(model: nn.Module, plan: dict[str, ShardSpec], geometry: TPGeometry, rank: int
                     ) -> dict[str, torch.Tensor]:
    """Rank `rank`'s parameters, from a fully loaded model."""
    return {name: shard_tensor(param.detach(), plan[name], geometry, rank)
            for name, param in model.named_parameters()}
