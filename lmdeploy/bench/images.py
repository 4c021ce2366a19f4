"""Images of the multimodal bench workloads, drawn from their seeds (PIL; deterministic)."""
from __future__ import annotations

import random

from PIL import Image, ImageDraw

IMAGE_SIZE = (448, 448)


def draw_image(seed: int, size: tuple[int, int] = IMAGE_SIZE) -> Image.Image:
    """Coloured rectangles and ellipses on a coloured background; equal seeds give equal pixels."""
    rng = random.Random(seed)

    def colour() -> tuple[int, int, int]:
        return rng.randrange(256), rng.randrange(256), rng.randrange(256)
    image = Image.new('RGB', size, colour())
    draw = ImageDraw.Draw(image)
    w, h = size
    for _ in range(6):
        x0, y0 = rng.randrange(w * 3 // 4), rng.randrange(h * 3 // 4)
        box = (x0, y0, x0 + rng.randrange(8, w // 3), y0 + rng.randrange(8, h // 3))
        (draw.ellipse if rng.random() < 0.5 else draw.rectangle)(box, fill=colour())
    return image


def with_images(messages: list[dict], size: tuple[int, int] = IMAGE_SIZE) -> list[dict]:
    """`messages` with every `{'type': 'image', 'image': seed}` part's seed replaced by its drawn image."""
    out = []
    for message in messages:
        content = message['content']
        if isinstance(content, list):
            content = [{**part, 'image': draw_image(part['image'], size)} if part.get('type') == 'image' else part
                       for part in content]
        out.append({**message, 'content': content})
    return out
