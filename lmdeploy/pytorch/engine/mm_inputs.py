"""Per-forward multimodal inputs of one sequence: rotary positions (M-RoPE after images) and the images to embed.

Positions are a pure function of the sequence's spans (design invariant 11 holds because a checkpoint's identity
holds every span that starts before its step). A text token at index i sits at position `i + offset(i)` on all
three axes, where `offset(i)` sums the deltas of the spans ending at or before i; the tokens of an image starting
at index s sit at T = p, H = p + row, W = p + col with p = s + offset(s), and the image advances the position by
max(h, w) (merged units) instead of its token count. Reads sequences, never mutates them; no device work.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..messages import MultiModalSpan, SchedulerSequence
from ..model_inputs import ImagePixels, VisionItem


class SeqMultiModalInputs(NamedTuple):
    positions: np.ndarray               # [n] int64: rotary positions (the T axis for image tokens)
    mrope_positions: np.ndarray | None  # [3, n] int64 when the range holds image tokens, else None
    rows: np.ndarray                    # [m] int64: indices into the range of the tokens taking image embeddings
    items: list[VisionItem]             # the images those rows come from, in row order


def _text_offsets(spans: tuple[MultiModalSpan, ...], idx: np.ndarray) -> np.ndarray:
    ends = np.fromiter((s.end for s in spans), np.int64, len(spans))
    cum = np.concatenate(([0], np.cumsum([s.position_delta for s in spans], dtype=np.int64)))
    return cum[np.searchsorted(ends, idx, side='right')]


def sequence_mm_inputs(seq: SchedulerSequence, start: int, n: int) -> SeqMultiModalInputs:
    """Positions and images of tokens `[start, start + n)` of `seq` (spans sorted and disjoint)."""
    idx = np.arange(start, start + n, dtype=np.int64)
    spans = seq.mm_spans
    if not spans:
        return SeqMultiModalInputs(idx, None, np.zeros(0, np.int64), [])
    positions = idx + _text_offsets(spans, idx)
    mrope, rows, items = None, [], []
    end = start + n
    for span in spans:
        lo, hi = max(span.start, start), min(span.end, end)
        if lo >= hi or span.grid is None:
            continue
        if mrope is None:
            mrope = np.broadcast_to(positions, (3, n)).copy()
        _, h, w = span.grid
        base = span.start + seq.position_offset(span.start)
        local = np.arange(lo - span.start, hi - span.start, dtype=np.int64)
        within = local % (h * w)
        cols = slice(lo - start, hi - start)
        mrope[0, cols] = base + local // (h * w)
        mrope[1, cols] = base + within // w
        mrope[2, cols] = base + within % w
        positions[cols] = mrope[0, cols]
        if isinstance(span.data, ImagePixels):
            rows.append(np.arange(lo - start, hi - start, dtype=np.int64))
            items.append(VisionItem(span.content_hash, span.data, lo - span.start, hi - lo))
    rows_arr = np.concatenate(rows) if rows else np.zeros(0, np.int64)
    return SeqMultiModalInputs(positions, mrope, rows_arr, items)


def validate_mm_spans(token_ids: list[int], spans: tuple[MultiModalSpan, ...], image_token_id: int | None) -> None:
    """Raise `ValueError` unless the spans are sorted, disjoint, inside the prompt, hold only the image token, and
    carry pixels whose grid yields exactly their length."""
    if not spans:
        return
    if image_token_id is None:
        raise ValueError('this model takes no images (no vision tower)')
    prev_end = 0
    for span in spans:
        if not prev_end <= span.start < span.end <= len(token_ids):
            raise ValueError(f'image span [{span.start}, {span.end}) overlaps another or leaves the prompt')
        if any(t != image_token_id for t in token_ids[span.start:span.end]):
            raise ValueError(f'image span [{span.start}, {span.end}) holds tokens other than the image token')
        if not isinstance(span.data, ImagePixels) or span.grid is None:
            raise ValueError('an image span needs its pixels and grid')
        t, h, w = span.grid
        if t * h * w != span.end - span.start:
            raise ValueError(f'image span [{span.start}, {span.end}) does not match its grid {span.grid}')
        prev_end = span.end
