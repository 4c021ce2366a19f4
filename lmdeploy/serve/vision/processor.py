"""Images -> the engine's image spans, through the checkpoint's own image processor.

`preprocessor_config.json` (min / max pixels, patch and merge sizes, normalisation) is loaded with transformers'
`AutoImageProcessor` (the Qwen2-VL processor; its PIL variant where torchvision is absent). An image becomes
`pixel_values [t * h * w, C * temporal_patch * patch**2]` and a patch grid (t, h, w); its one placeholder token in
the templated prompt expands to `t * h * w / merge**2` copies, and the span over them carries a content hash of
the preprocessed pixels (bytes, dtype, shape) and grid, which is the image's identity in the prefix cache and the
vision-encoder cache.
"""
from __future__ import annotations

import os

import numpy as np
import torch
import xxhash

from ...pytorch.messages import MultiModalSpan
from ...pytorch.model_inputs import ImagePixels


def image_content_hash(pixels: ImagePixels) -> int:
    """xxh3 over the pixel bytes, their dtype and shape, and the patch grid, as a non-negative int64 (the prefix
    cache packs identities into int64 arrays)."""
    values = pixels.pixel_values.detach().cpu().contiguous()
    digest = xxhash.xxh3_64()
    digest.update(f'{values.dtype}|{tuple(values.shape)}|{tuple(pixels.grid_thw)}|'.encode())
    digest.update(values.view(torch.uint8).numpy().tobytes() if values.numel() else b'')
    return digest.intdigest() & 0x7FFF_FFFF_FFFF_FFFF


class ImageProcessor:

    def __init__(self, model_path: str, image_token_id: int):
        if not os.path.isfile(os.path.join(model_path, 'preprocessor_config.json')):
            raise ValueError(f'{model_path!r} has no preprocessor_config.json: cannot preprocess images')
        from transformers import AutoImageProcessor
        self._processor = AutoImageProcessor.from_pretrained(model_path)
        self.merge_size = int(getattr(self._processor, 'merge_size', 2))
        self.image_token_id = image_token_id

    def preprocess(self, image) -> ImagePixels:
        """One RGB PIL image -> its pixels and patch grid."""
        try:
            out = self._processor(images=[image], return_tensors='pt')
        except (ValueError, TypeError, OSError) as exc:
            raise ValueError(f'cannot preprocess the image: {exc}') from None
        grid = tuple(int(x) for x in out['image_grid_thw'][0].tolist())
        return ImagePixels(out['pixel_values'].to(torch.float32), grid)

    def num_tokens(self, pixels: ImagePixels) -> int:
        t, h, w = pixels.grid_thw
        return t * h * w // self.merge_size ** 2

    def expand(self, token_ids: list[int], images: list) -> tuple[list[int], tuple[MultiModalSpan, ...]]:
        """Replace the i-th image placeholder of `token_ids` by image i's merged-token count of placeholders; returns
        the new ids and one span per image."""
        ids = np.asarray(token_ids, dtype=np.int64)
        where = np.flatnonzero(ids == self.image_token_id).tolist()
        if len(where) != len(images):
            raise ValueError(f'the prompt has {len(where)} image placeholders for {len(images)} images')
        out: list[int] = []
        spans = []
        prev = 0
        for pos, image in zip(where, images):
            pixels = self.preprocess(image)
            out += token_ids[prev:pos]
            start, n = len(out), self.num_tokens(pixels)
            out += [self.image_token_id] * n
            t, h, w = pixels.grid_thw
            spans.append(MultiModalSpan(start, start + n, image_content_hash(pixels),
                                        grid=(t, h // self.merge_size, w // self.merge_size), data=pixels))
            prev = pos + 1
        out += token_ids[prev:]
        return out, tuple(spans)
