"""Caption scores of the GCG benchmark without Java: a PTB-like tokenizer and CIDEr-D as the COCO caption toolkit
computes it.

GLaMM scores GCG captions with ``pycocoevalcap`` (``COCOEvalCap``: the Stanford PTB tokenizer, then BLEU, METEOR,
ROUGE-L, CIDEr, SPICE), whose tokenizer and METEOR are Java programs shipped as jars inside that package. Neither the
package nor its jars are in this environment, so:

- **Tokenizer** (`ptb_tokenize`): a Python approximation of what ``COCOEvalCap`` feeds its scorers: lower case,
  clitics split off the way the PTB tokenizer splits them (``don't`` -> ``do n't``, ``man's`` -> ``man 's``),
  punctuation split off and then dropped (the toolkit drops ``'' ' `` ` -LRB- -RRB- -LCB- -RCB- . ? ! , : - -- ... ;``;
  brackets and quotes become those symbols in PTB, so they go too), hyphenated words, decimals and abbreviations kept
  whole. It matches the PTB tokenizer on plain captions; rarer constructs (URLs, odd quotes, ``cannot``) may tokenize
  differently, so a figure may differ from the toolkit's in the last digit.
- **CIDEr** (`cider_d`): the toolkit's ``Cider`` scorer, which is CIDEr-D (Vedantam et al. 2015): 1- to 4-grams,
  TF-IDF vectors whose document frequencies come from the references of the *evaluated set* (an n-gram absent from
  every reference gets ``df = 1``), per n the clipped cosine ``sum min(h, r) * r / (|h| |r|)``, a Gaussian length
  penalty ``exp(-(l_h - l_r)^2 / (2 * 6^2))`` where, as in the toolkit, a caption's length is its number of bigrams,
  the mean over n and over references, times 10; the corpus score is the mean over images.
- **METEOR is not computed** (a named gap): it needs the METEOR 1.5 jar and its paraphrase tables. The evaluation
  writes its captions in COCO's result format (``<stem>.captions.json``) so that ``pycocoevalcap`` run elsewhere
  scores METEOR against GranD-f's ``{split}_gcg_coco_caption_gt.json`` directly.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Mapping, Sequence

__all__ = ["PTB_PUNCTUATION", "cider_d", "ptb_tokenize"]

PTB_PUNCTUATION = frozenset(
    ["''", "'", "``", "`", "-lrb-", "-rrb-", "-lcb-", "-rcb-", ".", "?", "!", ",", ":", "-", "--", "...", ";"]
)
"""Tokens the COCO caption toolkit drops after PTB tokenization (lower-cased: its tokenizer runs with -lowerCase)."""

_CLITIC = re.compile(r"(?<=\w)(n't|'s|'re|'ve|'ll|'d|'m)\b")
_TOKEN = re.compile(r"n't|'(?:s|re|ve|ll|d|m)\b|\.\.\.|--|\w+(?:[-./&'@]\w+)*|\S")
_BRACKETS = frozenset('()[]{}"')


def ptb_tokenize(text: str) -> list[str]:
    """Lower-cased PTB-like tokens of ``text`` with the toolkit's punctuation dropped (module docstring):
    ``"A man's T-shirt, (red)."`` -> ``["a", "man", "'s", "t-shirt", "red"]``."""
    text = _CLITIC.sub(r" \1", text.lower().replace("\u2019", "'"))
    return [t for t in _TOKEN.findall(text) if t not in PTB_PUNCTUATION and t not in _BRACKETS]


def _ngrams(tokens: Sequence[str], n: int = 4) -> Counter:
    return Counter(tuple(tokens[i : i + k]) for k in range(1, n + 1) for i in range(len(tokens) - k + 1))


def cider_d(
    candidates: Mapping[str, str], references: Mapping[str, Sequence[str]], *, n: int = 4, sigma: float = 6.0
) -> tuple[float, dict[str, float]]:
    """``(corpus CIDEr-D, per-image CIDEr-D)`` of one candidate caption per image against its reference captions
    (module docstring); both maps are keyed by image id, every candidate needs references. Captions are tokenized by
    `ptb_tokenize` here; the scores are on the toolkit's scale (x10)."""
    missing = [k for k in candidates if not references.get(k)]
    if missing:
        raise ValueError(f"cider_d: {len(missing)} captions have no reference (first: {missing[0]!r})")
    if not candidates:
        return float("nan"), {}
    keys = list(candidates)
    refs = {k: [_ngrams(ptb_tokenize(r), n) for r in references[k]] for k in keys}
    df: Counter = Counter()
    for k in keys:  # an image counts once per n-gram, however many of its references hold it
        df.update({g for r in refs[k] for g in r})
    log_n_images = math.log(len(keys))

    def vector(counts: Counter) -> tuple[list[dict], list[float], int]:
        vec: list[dict] = [{} for _ in range(n)]
        norm = [0.0] * n
        length = 0
        for gram, tf in counts.items():
            k = len(gram) - 1
            vec[k][gram] = tf * (log_n_images - math.log(max(1.0, df[gram])))
            norm[k] += vec[k][gram] ** 2
            if k == 1:  # the toolkit's "length" is the bigram count
                length += tf
        return vec, [math.sqrt(v) for v in norm], length

    per: dict[str, float] = {}
    for k in keys:
        hv, hn, hl = vector(_ngrams(ptb_tokenize(candidates[k]), n))
        total = [0.0] * n
        for r in refs[k]:
            rv, rn, rl = vector(r)
            penalty = math.exp(-((hl - rl) ** 2) / (2 * sigma**2))
            for i in range(n):
                val = sum(min(w, rv[i].get(g, 0.0)) * rv[i].get(g, 0.0) for g, w in hv[i].items())
                if hn[i] != 0 and rn[i] != 0:
                    val /= hn[i] * rn[i]
                total[i] += val * penalty
        per[k] = sum(total) / n / len(refs[k]) * 10.0
    return sum(per.values()) / len(per), per
