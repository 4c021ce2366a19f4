"""How a model's heads divide over `tp` tensor-parallel ranks, and the check that they do.

Invariants (each rank holds the same number of every kind of head, so every rank runs the same kernels on equal
shapes and the state and KV pools have identical logical ids on every rank):
- `tp` divides the attention (query) heads;
- `tp` divides the gated-delta key heads (value heads are a multiple of key heads, so it divides those too);
- `tp` divides the KV heads, or the KV heads divide `tp` and each is replicated on `tp / n_kv` ranks.
"""
from __future__ import annotations

from dataclasses import dataclass


class TensorParallelError(ValueError):
    """`tp` does not fit the model, or asks for what the engine cannot run yet (the CLI prints it in one line)."""


@dataclass(frozen=True)
class TPGeometry:
    """Per-rank head counts of one model under `tp` ranks (0 where the model has no such layer)."""
    tp: int
    num_heads: int
    num_kv_heads: int
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0

    @property
    def kv_replicas(self) -> int:
        """Ranks that hold a copy of each KV head (1 when `tp` divides the KV heads)."""
        return max(1, self.tp // self.num_kv_heads)

    @property
    def heads_per_rank(self) -> int:
        return self.num_heads // self.tp

    @property
    def kv_heads_per_rank(self) -> int:
        return max(1, self.num_kv_heads // self.tp)

    def kv_head_range(self, rank: int) -> tuple[int, int]:
        """The global KV heads `[start, stop)` rank `rank` holds (with replication, one head shared by ranks)."""
        if self.num_kv_heads >= self.tp:
            n = self.num_kv_heads // self.tp
            return rank * n, (rank + 1) * n
        head = rank // self.kv_replicas
        return head, head + 1


def text_config_of(hf_config):
    return getattr(hf_config, 'text_config', None) or hf_config


def tp_geometry(hf_config, tp: int) -> TPGeometry:
    """The geometry of `hf_config` (a transformers config; VL configs nest `text_config`) under `tp` ranks;
    `ValueError` naming the count that does not divide."""
    if not isinstance(tp, int) or tp < 1:
        raise TensorParallelError(f'tp must be a positive int, got {tp!r}')
    cfg = text_config_of(hf_config)
    heads = cfg.num_attention_heads
    kv = getattr(cfg, 'num_key_value_heads', None) or heads
    lin_k = getattr(cfg, 'linear_num_key_heads', 0) or 0
    lin_v = getattr(cfg, 'linear_num_value_heads', 0) or 0
    if heads % tp:
        raise TensorParallelError(f'tp={tp} does not divide the attention heads (num_attention_heads={heads})')
    if kv % tp and tp % kv:
        raise TensorParallelError(f'tp={tp} neither divides the KV heads (num_key_value_heads={kv}) nor is a '
                                  'multiple of them (KV heads are replicated only when their count divides tp)')
    if lin_k % tp:
        raise TensorParallelError(f'tp={tp} does not divide the gated-delta key heads (linear_num_key_heads={lin_k})')
    return TPGeometry(tp=tp, num_heads=heads, num_kv_heads=kv, linear_num_key_heads=lin_k,
                      linear_num_value_heads=lin_v)


def check_tp_supported(model_path: str, tp: int, *, adapters: bool = False, speculative: bool = False) -> None:
    """Engine start, before any weight is read or any process is spawned: the model's heads must divide over `tp`
    ranks (`TensorParallelError` naming the count that does not), and `tp > 1` is refused with what it cannot be
    combined with yet (LoRA adapters, speculative decoding: their layers are not sharded). tp=1 reads nothing."""
    if tp == 1:
        return
    from .loader import load_hf_config
    tp_geometry(load_hf_config(model_path), tp)
    for used, what in ((adapters, 'LoRA adapters'), (speculative, 'speculative decoding')):
        if used:
            raise TensorParallelError(f'tp={tp}: tensor parallelism cannot be combined with {what} yet; run with '
                                      'tp=1')


def rank_hf_config(hf_config, tp: int):
    """A copy of `hf_config` describing one rank's model: a model class built from it has exactly the shapes of
    one rank's shards (`tp_plan.py`), and its `build_model_config` gives the per-rank KV heads and state shapes
    (conv `[conv_dim / tp, K - 1]`, recurrent `[n_v / tp, d_k, d_v]`)."""
    import copy
    tp_geometry(hf_config, tp)
    cfg = copy.deepcopy(hf_config)
    text = text_config_of(cfg)
    text.num_attention_heads //= tp
    text.num_key_value_heads = max(1, text.num_key_value_heads // tp)
    for name in ('linear_num_key_heads', 'linear_num_value_heads', 'intermediate_size', 'moe_intermediate_size',
                 'shared_expert_intermediate_size'):
        if getattr(text, name, None):
            setattr(text, name, getattr(text, name) // tp)
    return cfg
