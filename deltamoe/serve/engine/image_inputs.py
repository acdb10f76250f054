"""A request's images inside the engine: where their placeholder tokens sit, their prefix-cache keys,
and their embeddings while the prompt is being computed.

- Placement: image k owns the next `num_tokens` placeholder positions of the prompt, in order
  (the chat template writes them; a plain-text prompt gets them in front, see `place_images`).
- Prefix caching: a block's hash and token check see each placeholder as a key made from its
  image's content hash (`cache_keys`), so the same image twice is a hit and a different image
  with the same text is not.
- Encoding: `ModelRunner` runs the tower once per image, for every image a step's chunks reach
  that has no embeddings yet, all of the step's images in one packed call (`encode_pending`);
  embeddings are dropped once the prompt has passed them (a preempted request encodes again).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

import torch

from deltamoe.errors import RequestError
from deltamoe.vision.preprocess import PreparedImage

_KEY_SPACE = 1 << 62


@dataclass(eq=False)
class SequenceImages:
    images: list[PreparedImage]
    positions: list[int]  # prompt positions of every placeholder, ascending; image k owns a run of num_tokens
    embeds: list[torch.Tensor | None] = field(default_factory=list)  # [num_tokens, D] per image while needed

    def __post_init__(self) -> None:
        self.embeds = [None] * len(self.images)
        self._offsets = [0]
        for img in self.images:
            self._offsets.append(self._offsets[-1] + img.num_tokens)
        # a negative key per image: never equal to a real token id
        keys = [-1 - img.content_hash % _KEY_SPACE for img in self.images]
        self._key_at = {pos: keys[k] for k in range(len(self.images))
                        for pos in self.positions[self._offsets[k]:self._offsets[k + 1]]}

    def _span(self, k: int) -> tuple[int, int]:
        """[first, last] prompt positions of image k's placeholders."""
        return self.positions[self._offsets[k]], self.positions[self._offsets[k + 1] - 1]

    def cache_keys(self, tokens: list[int], start: int) -> list[int]:
        """tokens (= prompt[start:start + len]) with each placeholder replaced by its image's key."""
        lo = bisect.bisect_left(self.positions, start)
        if lo == len(self.positions) or self.positions[lo] >= start + len(tokens):
            return tokens
        return [self._key_at.get(start + i, t) for i, t in enumerate(tokens)]

    def missing(self, start: int, end: int) -> list[int]:
        """Images with placeholders in [start, end) and no embeddings yet."""
        return [k for k in range(len(self.images))
                if self.embeds[k] is None and self._span(k)[0] < end and self._span(k)[1] >= start]

    def rows(self, start: int, end: int) -> tuple[list[int], torch.Tensor | None]:
        """The placeholder positions in [start, end) (relative to start) and their embedding rows, in order."""
        lo, hi = bisect.bisect_left(self.positions, start), bisect.bisect_left(self.positions, end)
        if lo == hi:
            return [], None
        parts = []
        for k in range(len(self.images)):
            a, b = max(lo, self._offsets[k]), min(hi, self._offsets[k + 1])
            if a < b:
                parts.append(self.embeds[k][a - self._offsets[k]:b - self._offsets[k]])
        return [p - start for p in self.positions[lo:hi]], torch.cat(parts)

    def release_before(self, position: int) -> None:
        """Forget the embeddings of images whose placeholders all lie before `position`."""
        for k in range(len(self.images)):
            if self.embeds[k] is not None and self._span(k)[1] < position:
                self.embeds[k] = None


def place_images(ids: list[int], images: list[PreparedImage], placeholder_id: int | None,
                 text_prompt: bool) -> tuple[list[int], SequenceImages]:
    """Prompt ids with the images' placeholder tokens, and where each image sits.

    A token-id prompt must already hold exactly sum(num_tokens) placeholders (the chat template
    writes them); a text prompt cannot spell the placeholder, so its images go in front, in order."""
    if placeholder_id is None:
        raise RequestError("this model has no vision tower (no media_placeholder_token_id)", field="images")
    need = sum(img.num_tokens for img in images)
    if text_prompt:
        ids = [placeholder_id] * need + ids
    positions = [i for i, t in enumerate(ids) if t == placeholder_id]
    if len(positions) != need:
        raise RequestError(f"the prompt holds {len(positions)} image placeholder tokens (id {placeholder_id}) but "
                           f"its {len(images)} image(s) need {need}", field="prompt")
    return ids, SequenceImages(list(images), positions)


@dataclass(slots=True)
class CallImages:
    """The image rows of one model call: embeddings [n, D] for the (row, column) positions in order."""

    positions: list[tuple[int, int]]
    embeds: torch.Tensor

    def mask(self, batch: int, length: int, device: torch.device) -> torch.Tensor:
        m = torch.zeros(batch, length, dtype=torch.bool, device=device)
        rows, cols = zip(*self.positions)
        m[list(rows), list(cols)] = True
        return m


def call_images(group: list[tuple[object, int]]) -> CallImages | None:
    """Gather the embeddings of the placeholders a call's chunks cover (None when there are none)."""
    positions: list[tuple[int, int]] = []
    parts: list[torch.Tensor] = []
    for row, (seq, n) in enumerate(group):
        images: SequenceImages | None = seq.images
        if images is None:
            continue
        cols, embeds = images.rows(seq.num_computed, seq.num_computed + n)
        if embeds is not None:
            positions += [(row, c) for c in cols]
            parts.append(embeds)
    return CallImages(positions, torch.cat(parts)) if parts else None


def encode_pending(model, items: list[tuple[object, int]]) -> None:
    """Run the vision tower once for every image this step's chunks reach that has no embeddings."""
    todo = [(seq.images, k) for seq, n in items if seq.images is not None
            for k in seq.images.missing(seq.num_computed, seq.num_computed + n)]
    if not todo:
        return
    unique: dict[int, torch.Tensor] = {}  # the same image in several requests is encoded once
    for images, k in todo:
        img = images.images[k]
        unique.setdefault(img.content_hash, img.pixels)
    encoded = dict(zip(unique, model.encode_images([p.to(model.device, model.dtype) for p in unique.values()])))
    for images, k in todo:
        images.embeds[k] = encoded[images.images[k].content_hash]
