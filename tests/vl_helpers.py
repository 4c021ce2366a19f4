"""Shared helpers of the vision-language tests: images drawn with PIL, prompts with image parts, the tiny Qwen3.5-VL
checkpoint with transformers' model, tokenizer and image processor, prompts encoded with their image spans, the
transformers reference forward."""
from __future__ import annotations

import torch
from PIL import Image, ImageDraw

from lmdeploy.pytorch.messages import MultiModalSpan


def draw_image(seed: int, size: tuple[int, int]) -> Image.Image:
    """A small picture of shapes; different seeds give different pixels."""
    gen = torch.Generator().manual_seed(seed)

    def colour() -> tuple[int, int, int]:
        return tuple(int(c) for c in torch.randint(0, 256, (3,), generator=gen))
    image = Image.new('RGB', size, colour())
    draw = ImageDraw.Draw(image)
    w, h = size
    for _ in range(4):
        x0, y0 = int(torch.randint(0, w // 2, (1,), generator=gen)), int(torch.randint(0, h // 2, (1,), generator=gen))
        x1, y1 = x0 + w // 3, y0 + h // 3
        if torch.rand(1, generator=gen) < 0.5:
            draw.ellipse((x0, y0, x1, y1), fill=colour())
        else:
            draw.rectangle((x0, y0, x1, y1), fill=colour())
    draw.line((0, 0, w - 1, h - 1), fill=colour(), width=3)
    return image


def user_message(*parts) -> list[dict]:
    """One user turn from text strings and PIL images, in order."""
    content = [{'type': 'text', 'text': p} if isinstance(p, str) else {'type': 'image', 'image': p} for p in parts]
    return [{'role': 'user', 'content': content}]


def reference_logits(model, token_ids: list[int], spans: tuple[MultiModalSpan, ...], image_token_id: int
                     ) -> torch.Tensor:
    """transformers' logits [T, V] of one prompt with its images (float32)."""
    ids = torch.tensor([token_ids])
    kwargs = {}
    if spans:
        kwargs = dict(pixel_values=torch.cat([s.data.pixel_values for s in spans]),
                      image_grid_thw=torch.tensor([s.data.grid_thw for s in spans]),
                      mm_token_type_ids=(ids == image_token_id).int())
    with torch.no_grad():
        return model(input_ids=ids, **kwargs).logits[0].float()


def load_vl(path: str) -> tuple:
    """`(path, model, tokenizer, processor)` of the Qwen3.5-VL checkpoint at `path`: transformers' model (float32,
    eval), the engine's tokenizer and image processor."""
    import transformers

    from lmdeploy.serve.tokenizer import Tokenizer
    from lmdeploy.serve.vision.processor import ImageProcessor
    model = transformers.Qwen3_5ForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    return path, model, Tokenizer(path), ImageProcessor(path, model.config.image_token_id)


def encode(vl: tuple, *parts) -> tuple[list[int], tuple[MultiModalSpan, ...]]:
    """One user turn of text and images (`user_message`) through the chat template: the expanded prompt ids and its
    image spans."""
    _, _, tokenizer, processor = vl
    ids = tokenizer.encode(tokenizer.apply_chat_template(user_message(*parts)), add_special_tokens=False)
    return processor.expand(ids, [p for p in parts if not isinstance(p, str)])
