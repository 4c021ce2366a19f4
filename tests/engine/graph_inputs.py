"""Model inputs for the CUDA-graph tests: small decode and prefill batches with recognisable values."""
from __future__ import annotations

import torch

from lmdeploy.pytorch.model_inputs import ModelInputs


def decode_inputs(batch: int, width: int) -> ModelInputs:
    """A decode batch of `batch` sequences (one token each) whose block tables are `width` pages wide."""
    ar = torch.arange(batch, dtype=torch.int64)
    return ModelInputs(
        input_ids=ar + 100, position_ids=ar + 10, q_lens=torch.ones(batch, dtype=torch.int64), kv_lens=ar + 11,
        cu_seqlens_q=torch.arange(batch + 1), block_tables=(ar[:, None] * width + torch.arange(width)) + 1,
        slot_mapping=ar * 64 + 5, logits_indices=ar, state_ids=ar + 1, is_fresh=torch.zeros(batch, dtype=torch.bool),
        q_lens_list=[1] * batch, kv_lens_list=(ar + 11).tolist(), max_seqlen_q=1, max_seqlen_k=batch + 10)


def prefill_inputs(lens: list[int], kv_lens: list[int] | None = None) -> ModelInputs:
    """A prefill batch; the first sequence continues from its slot when it has history (kv_len > q_len)."""
    total, kv_lens = sum(lens), kv_lens or list(lens)
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    return ModelInputs(
        input_ids=torch.arange(total) + 1, position_ids=torch.arange(total) + 3, q_lens=torch.tensor(lens),
        kv_lens=torch.tensor(kv_lens), cu_seqlens_q=torch.tensor(cu),
        block_tables=torch.arange(len(lens) * 3).view(len(lens), 3) + 1, slot_mapping=torch.arange(total) + 40,
        logits_indices=torch.tensor(cu[1:]) - 1, state_ids=torch.arange(len(lens)) + 2,
        is_fresh=torch.tensor([q == kv for q, kv in zip(lens, kv_lens)]), q_lens_list=lens, kv_lens_list=kv_lens,
        max_seqlen_q=max(lens), max_seqlen_k=max(kv_lens))
