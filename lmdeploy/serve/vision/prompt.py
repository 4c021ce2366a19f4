"""Images of a prompt: the `(text, images)` pipeline form, and the image parts of chat messages in order.

A message's `content` may be a list of OpenAI-style parts (`text`, `image_url`, `image`); the chat template turns
each image part into one placeholder, so the i-th placeholder of the rendered prompt is the i-th image part here.
Video parts are refused.
"""
from __future__ import annotations

from PIL import Image

from .images import image_source_of_part


def is_image_tuple(prompt) -> bool:
    """`(text, image)` or `(text, [images])`: one prompt with images (LMDeploy's VL pipeline form). A list of
    images may hold PIL images, paths or URLs; a single image must be a PIL image (a second string is a batch)."""
    if not (isinstance(prompt, tuple) and len(prompt) == 2 and isinstance(prompt[0], str)):
        return False
    images = prompt[1]
    return isinstance(images, Image.Image) or (isinstance(images, list) and len(images) > 0)


def messages_of_image_tuple(prompt: tuple) -> list[dict]:
    text, images = prompt
    images = images if isinstance(images, list) else [images]
    parts = [{'type': 'image', 'image': image} for image in images]
    return [{'role': 'user', 'content': parts + [{'type': 'text', 'text': text}]}]


def image_sources(prompt) -> list:
    """The image sources of a prompt's messages, in order (empty for text prompts and token ids)."""
    if not isinstance(prompt, list | tuple):
        return []
    sources = []
    for message in prompt:
        content = message.get('content') if isinstance(message, dict) else None
        if not isinstance(content, list):
            continue
        for part in content:
            if not isinstance(part, dict):
                raise ValueError(f'a content part must be an object, got {type(part).__name__}')
            source = image_source_of_part(part)
            if source is not None:
                sources.append(source)
    return sources
