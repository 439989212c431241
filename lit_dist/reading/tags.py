"""A dataset's captions as training reads them: its comma-separated tags in one of a few fixed orders, and its own
caption dropout (kohya's ``--shuffle_caption``, ``--keep_tokens`` and ``caption_dropout_rate``; SimpleTuner's
``caption_dropout_probability``).

Orders are a fixed few per caption, not a fresh shuffle every time, so that a caption cache holds each once: a
cache of one encoding per caption would undo the shuffle, and encoding on every step would run the text encoders
beside the model. Order 0 is the caption as written; order k > 0 keeps its first ``keep_tokens`` tags in front and
shuffles the others with a generator seeded by (k, the caption), the same text on every rank, process and resume. A training sample reads order ``sample_word(seed, epoch, index) % orders``, drawn as its crop
is (a resumed run reads the same); evaluation reads order 0.

The text of order k follows from (caption, k, keep_tokens) alone: the cache keys its entries by those
(``cache.keys.caption_order``), never by the shuffled text, so a run's start needs no pass over its captions. The
shuffle below is therefore part of the cache's format: changing it changes ``RULE``, which changes every key of an
order k > 0.
"""

import random
from dataclasses import dataclass

from lit_dist.reading.hashing import sample_word

RULE = 1  # the shuffle's version, folded into the cache key of every shuffled order
TAG_STREAM = 1  # sample_word's stream of tag orders (0 is the crop's)


@dataclass(frozen=True)
class CaptionRule:
    """What a dataset's training batches do to its captions (``DatasetSource``'s fields of the same names)."""

    tag_orders: int = 1
    keep_tokens: int = 0
    caption_dropout: float | None = None

    def order(self, seed: int, epoch: int, index: int) -> int:
        """The tag order training sample ``index`` reads in ``epoch``."""
        if self.tag_orders <= 1:
            return 0
        return sample_word(seed, epoch, index, TAG_STREAM) % self.tag_orders


def ordered(caption: str, order: int, keep_tokens: int) -> str:
    """``caption``'s tags in order ``order``: 0 as written; else stripped, the first ``keep_tokens`` in front, the
    rest shuffled, joined by ", " (kohya's format)."""
    if order == 0 or not caption:
        return caption
    tags = [tag.strip() for tag in caption.strip().split(",")]
    kept, rest = tags[:keep_tokens], tags[keep_tokens:]
    # A str seed is hashed with SHA-512 (random's version 2): the same on every interpreter, whatever PYTHONHASHSEED.
    random.Random(f"{order}\0{caption}").shuffle(rest)
    return ", ".join(kept + rest)

