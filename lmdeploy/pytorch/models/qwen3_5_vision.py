"""The Qwen3.5 vision tower (`model.visual.*`, configured by `vision_config`).

pixels [num_patches, C * tp * p * p] (the image processor's rows, in 2x2 merge-block order)
  -> patch embedding (a Conv3d with kernel = stride = (tp, p, p), i.e. one matmul per patch)
  -> + learned position embedding `pos_embed` [side * side, hidden], bilinearly resampled (align_corners) to each
     image's (h, w) patch grid and laid out in merge-block order like the pixels
  -> `depth` pre-LayerNorm blocks: bidirectional attention within each frame with 2-D rotary (the first half of
     the rotary frequencies rotate by the patch row, the second half by the column), GELU-tanh MLP
  -> merger: LayerNorm per patch, 2x2 neighbouring patches concatenated, MLP to the text hidden size.
The output has one row per merged token, images in input order; Qwen3.5 injects nothing else into the text model.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..model_inputs import upload_index_tensors
from ..nn.linear import Linear
from ..nn.vision import VisionAttention, VisionBatch

GridTHW = tuple[int, int, int]


class VisionMLP(nn.Module):

    def __init__(self, dim: int, hidden: int, activation: str):
        super().__init__()
        if activation not in ('gelu_pytorch_tanh', 'gelu'):
            raise NotImplementedError(f'vision activation {activation!r} is not supported')
        self.approximate = 'tanh' if activation == 'gelu_pytorch_tanh' else 'none'
        self.linear_fc1 = Linear(dim, hidden, bias=True)
        self.linear_fc2 = Linear(hidden, dim, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.gelu(self.linear_fc1(x), approximate=self.approximate))


class VisionBlock(nn.Module):

    def __init__(self, cfg):
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.hidden_size, eps=1e-6)
        self.norm2 = nn.LayerNorm(cfg.hidden_size, eps=1e-6)
        self.attn = VisionAttention(cfg.hidden_size, cfg.num_heads)
        self.mlp = VisionMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)

    def forward(self, x: torch.Tensor, batch: VisionBatch) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), batch)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):

    def __init__(self, cfg):
        super().__init__()
        self.merged_dim = cfg.hidden_size * cfg.spatial_merge_size ** 2
        self.norm = nn.LayerNorm(cfg.hidden_size, eps=1e-6)
        self.linear_fc1 = Linear(self.merged_dim, self.merged_dim, bias=True)
        self.linear_fc2 = Linear(self.merged_dim, cfg.out_hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x).view(-1, self.merged_dim)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class PatchEmbed(nn.Module):
    """Conv3d with kernel == stride over one patch each, stored as its matmul: `proj.weight` [hidden, C*tp*p*p]."""

    def __init__(self, cfg):
        super().__init__()
        self.patch_dim = cfg.in_channels * cfg.temporal_patch_size * cfg.patch_size ** 2
        self.proj = Linear(self.patch_dim, cfg.hidden_size, bias=True)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        if pixels.dim() != 2 or pixels.size(1) != self.patch_dim:
            raise ValueError(f'pixel_values must be [num_patches, {self.patch_dim}], got {tuple(pixels.shape)}')
        return self.proj(pixels.to(self.proj.weight.dtype))


def merge_block_order(grid: torch.Tensor, merge: int) -> torch.Tensor:
    """[h, w, ...] grid -> [h * w, ...] rows in the processor's patch order: 2-D blocks of merge x merge patches,
    blocks row-major, patches row-major inside a block."""
    h, w = grid.shape[:2]
    blocks = grid.reshape(h // merge, merge, w // merge, merge, *grid.shape[2:]).transpose(1, 2)
    return blocks.reshape(h * w, *grid.shape[2:])


class Qwen3_5VisionModel(nn.Module):

    def __init__(self, cfg):
        super().__init__()
        self.config = cfg
        self.merge = cfg.spatial_merge_size
        self.patch_embed = PatchEmbed(cfg)
        self.pos_embed = nn.Embedding(cfg.num_position_embeddings, cfg.hidden_size)
        self.num_grid_per_side = int(cfg.num_position_embeddings ** 0.5)
        head_dim = cfg.hidden_size // cfg.num_heads
        theta = float((getattr(cfg, 'rope_parameters', None) or {}).get('rope_theta', 10000.0))
        spatial = head_dim // 2
        inv_freq = 1.0 / theta ** (torch.arange(0, spatial, 2, dtype=torch.float32) / spatial)
        self.register_buffer('rotary_inv_freq', inv_freq, persistent=False)
        self.blocks = nn.ModuleList(VisionBlock(cfg) for _ in range(cfg.depth))
        self.merger = PatchMerger(cfg)

    def num_merged_tokens(self, grid_thw: GridTHW) -> int:
        t, h, w = grid_thw
        return t * h * w // self.merge ** 2

    def _position_embedding(self, h: int, w: int) -> torch.Tensor:
        side = self.num_grid_per_side
        table = self.pos_embed.weight.float().view(side, side, -1).permute(2, 0, 1)[None]
        resized = F.interpolate(table, size=(h, w), mode='bilinear', align_corners=True)[0].permute(1, 2, 0)
        return merge_block_order(resized, self.merge)

    def _rotary(self, h: int, w: int) -> torch.Tensor:
        rows = torch.arange(h, device=self.rotary_inv_freq.device)[:, None].expand(h, w)
        cols = torch.arange(w, device=self.rotary_inv_freq.device)[None, :].expand(h, w)
        coords = merge_block_order(torch.stack((rows, cols), dim=-1), self.merge).float()  # [h * w, 2]
        freqs = (coords[:, :, None] * self.rotary_inv_freq).flatten(1)  # [h * w, head_dim / 2]: rows, then cols
        return torch.cat((freqs, freqs), dim=-1)

    def _pack(self, grids: list[GridTHW], device: torch.device) -> tuple[torch.Tensor, VisionBatch]:
        pos, angles, lengths = [], [], []
        for t, h, w in grids:
            if h % self.merge or w % self.merge:
                raise ValueError(f'image grid {(t, h, w)} is not a multiple of the merge size {self.merge}')
            pos.append(self._position_embedding(h, w).repeat(t, 1))
            angles.append(self._rotary(h, w).repeat(t, 1))
            lengths += [h * w] * t
        cu = [0]
        for n in lengths:
            cu.append(cu[-1] + n)
        angle = torch.cat(angles)
        # one pinned non-blocking upload on CUDA: the forward never waits for the device here
        cu_seqlens = upload_index_tensors({'cu': torch.tensor(cu, dtype=torch.int64)}, device)['cu']
        batch = VisionBatch(cu_seqlens=cu_seqlens, cu_seqlens_list=cu,
                            max_seqlen=max(lengths), cos=angle.cos(), sin=angle.sin())
        return torch.cat(pos), batch

    def forward(self, pixel_values: torch.Tensor, grids: list[GridTHW]) -> torch.Tensor:
        """Merged embeddings [sum(t * h * w) / merge**2, out_hidden] of the images whose patches are packed in
        `pixel_values` (image i's rows follow image i - 1's)."""
        expected = sum(t * h * w for t, h, w in grids)
        if pixel_values.size(0) != expected:
            raise ValueError(f'{pixel_values.size(0)} patch rows for grids {grids} ({expected} patches)')
        x = self.patch_embed(pixel_values)
        pos, batch = self._pack(grids, x.device)
        x = x + pos.to(x.dtype)
        for block in self.blocks:
            x = block(x, batch)
        return self.merger(x)
