"""The course's two source texts and every phrase the course presents as their words: the one home of its quotations.

A phrase in quotation marks that a lesson, README or the claims table attributes to "the tutorial" or "the news item"
must be listed in ``QUOTATIONS`` with the text it comes from; ``tests/test_quotations.py`` checks each listed phrase
against the texts themselves where they are present (``../shared/sources/`` beside the repository, as in CI) and, on a
clone without them, checks the course's quotations against this list. Everything else the course says about the texts
is in its own words, without quotation marks.

Verbatim means the same characters after :func:`normalise`: typographic variants that render alike (the news item's
non-breaking hyphen U+2011 and an en dash in "10–15%", curly and straight quotation marks) and runs of whitespace count
as equal; nothing else does.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Source:
    key: str  # how the course names the text: "the tutorial", "the news item"
    title: str
    publisher: str  # "" where the text names none
    date: str  # "" where the text gives none
    file: str  # its copy in ../shared/sources/
    known: str  # what is known of where it comes from, in a sentence

    def citation(self) -> str:
        """Title, publisher and date, or what is known in their place."""
        parts = [f"\u201c{self.title}\u201d"] + [p for p in (self.publisher, self.date and f"published {self.date}") if p]
        return ", ".join(parts) + ("" if self.publisher else f" ({self.known})")


TUTORIAL = Source("tutorial", "Fast Attention Kernels and Operator Fusion", "", "", "tutorial.txt",
                  "no byline, publisher or date; the copy the course follows names Machine Learning Mastery as its "
                  "original source")
NEWS = Source("news item", "Fast Attention Kernels and Operator Fusion", "Tefisc Fact Engine",
              "November 12, 2026", "news-item.txt", "a news item that cites Machine Learning Mastery")
SOURCES = {s.key: s for s in (TUTORIAL, NEWS)}


@dataclass(frozen=True)
class Quotation:
    phrase: str  # as the course writes it; verbatim in each of ``sources`` after normalise()
    sources: tuple[str, ...]  # keys of SOURCES


def _q(phrase: str, *sources: Source) -> Quotation:
    return Quotation(phrase, tuple(s.key for s in sources))


QUOTATIONS = (
    # the two texts' shared title
    _q("Fast Attention Kernels and Operator Fusion", TUTORIAL, NEWS),
    # the news item
    _q("cutting kernel launch overhead by up to 70%", NEWS),
    _q("by up to 70%", NEWS),
    _q("up to 70%", NEWS),
    _q("delivering another 10–15% latency reduction", NEWS),
    _q("another 10–15%", NEWS),
    _q("another 10–15% latency reduction", NEWS),
    _q("sidesteps the quadratic memory blow-up", NEWS),
    _q("dropout, scaling, and residual addition", NEWS),
    _q("combining dropout, scaling, and residual addition directly into the attention kernel", NEWS),
    # the tutorial
    _q("Ordinary attention with an additive attention mask", TUTORIAL),
    _q("It avoids storing the complete score matrix in global memory", TUTORIAL),
    _q("Updating the KV cache while transforming key and value tensors", TUTORIAL),
    _q("It reduces fragmentation and reserved capacity", TUTORIAL),
    _q("PyTorch can implement paged attention with FlexAttention and torch.compile()", TUTORIAL),
    _q("compilation can change the order of floating-point operations", TUTORIAL),
    _q("PyTorch will log hints about CUDA Graph eligibility and other compiler choices", TUTORIAL),
    _q("Applying bias, activation, and element-wise multiplication", TUTORIAL),
    _q("Combining dequantization with matrix multiplication", TUTORIAL),
)

_VARIANTS = str.maketrans({"\u2010": "-", "\u2011": "-", "\u2012": "-", "\u2013": "-", "\u2019": "'", "\u2018": "'",
                           "\u201c": '"', "\u201d": '"'})


def normalise(text: str) -> str:
    """``text`` with typographic variants that render alike made equal and whitespace runs made one space."""
    return re.sub(r"\s+", " ", text.translate(_VARIANTS)).strip()


def registered(phrase: str) -> Quotation | None:
    """The registry's entry for ``phrase`` (compared after normalise), or None."""
    wanted = normalise(phrase)
    return next((q for q in QUOTATIONS if normalise(q.phrase) == wanted), None)


__all__ = ["NEWS", "QUOTATIONS", "SOURCES", "TUTORIAL", "Quotation", "Source", "normalise", "registered"]
