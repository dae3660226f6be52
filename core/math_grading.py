"""Math answer grading for the reasoning tasks (EvolvedGRPO's answer model): pure functions, never raising on model
output.

A completion reads ``<think>...</think> ... \\boxed{answer}``. :func:`extract_boxed` takes the content of the *last*
``\\boxed{...}`` (nested braces counted; an unclosed one is no answer). :func:`answers_match` decides whether two
answers are the same, in this order:

1. **Choice letters** (``A``, ``(B)``, ``C.``, ``D: 12 cm``, ``Option E``; capitals A-H): when either side is one,
   both must be the same letter.
2. **Numbers**, exact (``fractions.Fraction``): integers, decimals, ``1,000`` (thousands groups of three), ``\\frac{a}{b}``,
   ``\\frac12``, ``a/b``, a trailing unit (``cm``, ``m^2``, ``^\\circ``, ``degrees``, ...) stripped. A percentage
   equals its value and its value / 100 (``50%`` = ``50`` = ``0.5``): gold labels write it both ways.
3. **Tuples and sets** of the same bracket and length, element by element (in order; ``\\{...\\}`` in any order).
4. **Expressions** through sympy (``\\sqrt{2}/2`` = ``1/\\sqrt{2}``, ``2x+2`` = ``2(x+1)``): parsed only from a short
   whitelisted text (digits, single-letter variables, ``+ - * / ^ ( )``, ``sqrt``, ``pi``; at most 120 characters,
   integer literals of at most 30 digits, powers with a numeric exponent of at most 64, no power of a power), so a
   hostile answer cannot make sympy run for long; compared numerically (constants: relative 1e-9; with variables: at
   three fixed points, same variables on both sides).
5. Otherwise the normalised strings (``$``, ``\\left``/``\\right``, ``\\text{}``, spaces and case removed).

Rounding is not forgiven: ``0.33`` is not ``1/3``. The answer model's reward (the seed's ``math.py``):
``answer_reward = 0.9 * accuracy + 0.1 * format``, the format checked as the seed checks it (:func:`format_ok`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from fractions import Fraction
from typing import Any

__all__ = [
    "accuracy_reward",
    "answer_reward",
    "answers_match",
    "extract_boxed",
    "format_ok",
    "format_reward",
    "normalize_answer",
    "parse_choice",
    "parse_number",
]

_MAX_TEXT = 1_000_000
"""Characters of a completion that are read (a runaway completion is cut, not scanned forever)."""


def _text(completion: Any) -> str:
    """A completion as text: a string, or the content of a conversational completion (a list of messages)."""
    if isinstance(completion, str):
        return completion[:_MAX_TEXT]
    if isinstance(completion, dict):
        content = completion.get("content")
        return content[:_MAX_TEXT] if isinstance(content, str) else ""
    if isinstance(completion, (list, tuple)):
        return "".join(_text(m) for m in completion if isinstance(m, (str, dict)))[:_MAX_TEXT]
    return ""


# --- extraction ------------------------------------------------------------------------------------------------------

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")


def extract_boxed(text: Any) -> str | None:
    """Content (stripped) of the last closed ``\\boxed{...}`` (or ``\\fbox{...}``) in ``text``; None when there is
    none, the last one is never closed, or it is empty."""
    text = _text(text)
    starts = [m.end() for m in _BOXED.finditer(text)]
    if not starts:
        return None
    begin, depth = starts[-1], 1
    for i in range(begin, len(text)):
        c = text[i]
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return text[begin:i].strip() or None
    return None


# --- normalisation ---------------------------------------------------------------------------------------------------

_WRAPPERS = re.compile(r"\\(?:text|textbf|textrm|mathrm|mathbf|mbox|operatorname)\s*\{([^{}]*)\}")
_SPACING = re.compile(r"\\(?:left|right|displaystyle|,|!|;|:|quad|qquad)|\\ |~")
_DEGREES = re.compile(r"\^\s*\{?\s*\\circ\s*\}?|\\circ|\\degree|°")
_UNITS = (
    r"(?:square\s+units?|sq\.?\s*units?|units?|cm|mm|km|m|kg|mg|g|ml|l|s|sec|seconds?|min|minutes?|h|hours?|"
    r"degrees?|deg|dollars?|yuan|cents?|people|items?|apples?)(?:\^\{?[23]\}?|²|³)?"
)
_TRAILING_UNIT = re.compile(rf"(?<![A-Za-z])\s*{_UNITS}\.?$", re.IGNORECASE)
_ASSIGNMENT = re.compile(r"^[A-Za-z]\s*=\s*(?=[^=]+$)")


def _strip_math(s: str) -> str:
    s = s.strip()
    for left, right in (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
        while len(s) >= len(left) + len(right) and s.startswith(left) and s.endswith(right):
            s = s[len(left) : len(s) - len(right)].strip()
    return s


def _clean(answer: Any) -> str:
    """An answer with its LaTeX dressing removed, case kept: ``$\\text{12}\\,cm$`` -> ``12``."""
    if isinstance(answer, bool) or answer is None:
        return ""
    if isinstance(answer, (int, float, Fraction)):
        answer = str(answer)
    if not isinstance(answer, str):
        return ""
    s = _strip_math(answer[:10_000])
    for _ in range(4):  # nested wrappers: \text{\textbf{A}}
        s2 = _WRAPPERS.sub(r"\1", s)
        if s2 == s:
            break
        s = s2
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac").replace("{,}", ",")
    s = _SPACING.sub(" ", s)
    s = _DEGREES.sub("", s)
    s = s.replace("\\%", "%").strip().rstrip(".").strip()
    s = _ASSIGNMENT.sub("", s).strip()
    m = _TRAILING_UNIT.search(s)  # linear: the unit is matched at the end only (no backtracking over the number)
    if m and m.start() > 0 and parse_number(s[: m.start()]) is not None:
        s = s[: m.start()].strip()
    return s


def normalize_answer(answer: Any) -> str:
    """The comparison key of last resort: :func:`_clean`, then no whitespace, case-folded."""
    return re.sub(r"\s+", "", _clean(answer)).casefold()


_CHOICE = re.compile(r"^(?:(?:option|choice|answer)\s*:?\s*)?\(?([A-H])\)?(?:[.:)]\s*(?:.*))?$", re.IGNORECASE | re.S)


def parse_choice(answer: Any) -> str | None:
    """The choice letter of ``A``, ``(B)``, ``C.``, ``D: 12 cm``, ``Option E`` (capitals A-H), else None."""
    s = _clean(answer)
    m = _CHOICE.match(s)
    if m is None or not m.group(1).isupper():
        return None
    return m.group(1)


# --- numbers ---------------------------------------------------------------------------------------------------------

_DECIMAL = re.compile(r"^[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d{1,3})?$")
_THOUSANDS = re.compile(r"^[+-]?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")
_FRAC = re.compile(r"^([+-]?)\\frac\s*(?:\{([^{}]+)\}|(\d))\s*(?:\{([^{}]+)\}|(\d))$")
_SLASH = re.compile(r"^([^/]+)/([^/]+)$")
_MAX_DIGITS = 60


def _plain_number(s: str) -> Fraction | None:
    s = re.sub(r"^([+-])\s+", r"\1", s.strip())  # "- 3"; but "1 1/2" is no number here
    if _THOUSANDS.match(s):
        s = s.replace(",", "")
    if len(s) > _MAX_DIGITS or not _DECIMAL.match(s):
        return None
    try:
        return Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None


def _number_and_percent(answer: Any) -> tuple[Fraction, bool] | None:
    s = _clean(answer)
    percent = s.endswith("%")
    if percent:
        s = s[:-1].strip()
    s = s.strip("{}() ") if s.startswith("{") and s.endswith("}") else s
    value = _plain_number(s)
    if value is None and (m := _FRAC.match(s)):
        num, den = _plain_number(m.group(2) or m.group(3)), _plain_number(m.group(4) or m.group(5))
        if num is not None and den:
            value = -num / den if m.group(1) == "-" else num / den
    if value is None and (m := _SLASH.match(s)):
        num, den = _plain_number(m.group(1)), _plain_number(m.group(2))
        if num is not None and den:
            value = num / den
    return None if value is None else (value, percent)


def parse_number(answer: Any) -> Fraction | None:
    """The exact value of a number answer (``12``, ``-0.5``, ``1,000``, ``3/4``, ``\\frac{3}{4}``, ``12 cm``,
    ``45^\\circ``; ``50%`` -> 1/2), else None."""
    got = _number_and_percent(answer)
    if got is None:
        return None
    value, percent = got
    return value / 100 if percent else value


def _numbers_match(a: tuple[Fraction, bool], b: tuple[Fraction, bool]) -> bool:
    (x, px), (y, py) = a, b
    if px == py:
        return x == y
    pct, other = (x, y) if px else (y, x)
    return other in (pct, pct / 100)


# --- expressions (sympy) ---------------------------------------------------------------------------------------------

_MAX_EXPR = 120
_EXPR_CHARS = re.compile(r"^[0-9a-z.+\-*/()^ ]+$")
_NAMES = re.compile(r"[a-z]{2,}")
_POINT_VALUES = (0.7319, 1.4955, 2.3026)
"""Where expressions with variables are compared (variable k of the sorted set gets value + k): unremarkable points."""


def _latex_to_plain(s: str) -> str | None:
    """``\\frac{a}{b}`` -> ``((a)/(b))``, ``\\sqrt{x}`` -> ``sqrt(x)``, ``\\sqrt[n]{x}`` -> ``((x)**(1/(n)))``,
    ``\\pi`` -> ``pi``, ``\\cdot``/``\\times`` -> ``*``, ``\\div`` -> ``/``, braces -> parentheses; None when a
    backslash command is left over."""
    out, i = [], 0
    while i < len(s):
        if s.startswith("\\frac", i) or s.startswith("\\sqrt", i):
            cmd, i = s[i + 1 : i + 5], i + 5
            index = None
            if cmd == "sqrt" and i < len(s) and s[i] == "[":
                close = s.find("]", i)
                if close < 0:
                    return None
                index, i = _latex_to_plain(s[i + 1 : close]), close + 1
            args = []
            for _ in range(2 if cmd == "frac" else 1):
                while i < len(s) and s[i] == " ":
                    i += 1
                if i >= len(s):
                    return None
                if s[i] != "{":
                    args.append(_latex_to_plain(s[i]))
                    i += 1
                    continue
                depth, j = 1, i + 1
                while j < len(s) and depth:
                    depth += {"{": 1, "}": -1}.get(s[j], 0)
                    j += 1
                if depth:
                    return None
                args.append(_latex_to_plain(s[i + 1 : j - 1]))
                i = j
            if any(a is None for a in args) or (cmd == "sqrt" and index is None and s[i - 1 : i] == "]"):
                return None
            if cmd == "frac":
                out.append(f"(({args[0]})/({args[1]}))")
            elif index is not None:
                out.append(f"(({args[0]})**(1/({index})))")
            else:
                out.append(f"sqrt({args[0]})")
            continue
        for latex, plain in (("\\pi", "pi"), ("\\cdot", "*"), ("\\times", "*"), ("\\div", "/")):
            if s.startswith(latex, i):
                out.append(f" {plain} ")
                i += len(latex)
                break
        else:
            if s[i] == "\\":
                return None
            out.append({"{": "(", "}": ")"}.get(s[i], s[i]))
            i += 1
    return "".join(out)


def _sympy_expr(answer: Any):
    """A sympy expression for a short, whitelisted answer; None for anything else (never raises)."""
    s = _clean(answer)
    if not s or len(s) > _MAX_EXPR or re.search(r"\d\s+\d", s):
        return None  # "1 1/2" is a mixed number, not 1 * 1/2: refused rather than misread
    plain = _latex_to_plain(s)
    if plain is None:
        return None
    plain = plain.replace("**", "^").lower()
    if not _EXPR_CHARS.match(plain) or any(n not in ("sqrt", "pi") for n in _NAMES.findall(plain)):
        return None
    if any(len(d) > 30 for d in re.findall(r"\d+", plain)):
        return None
    try:
        import sympy
        from sympy.parsing.sympy_parser import (
            convert_xor,
            implicit_multiplication_application,
            parse_expr,
            standard_transformations,
        )

        transformations = standard_transformations + (implicit_multiplication_application, convert_xor)
        names = {c: sympy.Symbol(c) for c in "abcdefghijklmnopqrstuvwxyz"}
        names.update(sqrt=sympy.sqrt, pi=sympy.pi)
        expr = parse_expr(plain, local_dict=names, transformations=transformations, evaluate=False)
    except Exception:  # noqa: BLE001 - any parse failure is "not an expression"
        return None
    if not isinstance(expr, sympy.Expr):
        return None
    return expr if _bounded(expr) else None


def _bounded(node, depth: int = 0) -> bool:
    """Powers have a numeric exponent of at most 64 in size and nest at most two deep (``1/\\sqrt{2}`` is a power of
    a power), so evaluating the expression stays cheap: a tower like ``2^(2^(2^64))`` is refused unevaluated."""
    import sympy

    if isinstance(node, sympy.Pow):
        if (
            depth >= 2
            or node.exp.free_symbols
            or not (_bounded(node.exp, depth + 1) and _bounded(node.base, depth + 1))
        ):
            return False
        try:
            return abs(float(node.exp)) <= 64
        except (TypeError, ValueError, OverflowError):
            return False
    return all(_bounded(a, depth) for a in node.args)


def _complex(value) -> complex | None:
    try:
        z = complex(value.evalf(30))
    except (TypeError, ValueError, OverflowError, ZeroDivisionError, AttributeError):
        return None
    return z if math.isfinite(z.real) and math.isfinite(z.imag) else None


def _expressions_match(a: Any, b: Any) -> bool:
    ea, eb = _sympy_expr(a), _sympy_expr(b)
    if ea is None or eb is None:
        return False
    try:
        symbols = ea.free_symbols | eb.free_symbols
        if ea.free_symbols != eb.free_symbols:
            return False
        points = [{s: v + k for k, s in enumerate(sorted(symbols, key=str))} for v in _POINT_VALUES]
        for point in points if symbols else [{}]:
            za, zb = _complex(ea.subs(point)), _complex(eb.subs(point))
            if za is None or zb is None or abs(za - zb) > 1e-9 * max(1.0, abs(za), abs(zb)):
                return False
        return True
    except Exception:  # noqa: BLE001 - sympy may fail in many ways on odd input; that is "not equal"
        return False


# --- tuples ----------------------------------------------------------------------------------------------------------

_BRACKETS = {"(": ")", "[": "]", "\\{": "\\}", "{": "}"}


def _split_top(s: str) -> list[str]:
    parts, depth, start = [], 0, 0
    for i, c in enumerate(s):
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif c == "," and depth == 0:
            parts.append(s[start:i])
            start = i + 1
    parts.append(s[start:])
    return [p.strip() for p in parts]


def _elements(answer: Any) -> tuple[str, list[str]] | None:
    s = _clean(answer)
    for left, right in _BRACKETS.items():
        if s.startswith(left) and s.endswith(right):
            inner = s[len(left) : len(s) - len(right)]
            parts = _split_top(inner)
            return (left, parts) if len(parts) > 1 else None
    if "," in s and not _THOUSANDS.match(s.replace(" ", "")):
        parts = _split_top(s)
        return ("", parts) if len(parts) > 1 else None
    return None


# --- equivalence -----------------------------------------------------------------------------------------------------


def answers_match(pred: Any, gold: Any, _depth: int = 0) -> bool:
    """Whether answer ``pred`` is the same as ``gold`` (symmetric; rules in the module docstring); never raises."""
    try:
        return _answers_match(pred, gold, _depth)
    except Exception:  # noqa: BLE001 - grading must give a verdict on any model output
        return False


def _answers_match(pred: Any, gold: Any, depth: int) -> bool:
    if not normalize_answer(pred) or not normalize_answer(gold):
        return False
    cp, cg = parse_choice(pred), parse_choice(gold)
    if cp is not None or cg is not None:
        return cp == cg  # a letter against a non-letter ("a", "12") is no match
    if normalize_answer(pred) == normalize_answer(gold):
        return True
    np_, ng = _number_and_percent(pred), _number_and_percent(gold)
    if np_ is not None and ng is not None:
        return _numbers_match(np_, ng)
    tp, tg = _elements(pred), _elements(gold)
    if tp is not None or tg is not None:
        if tp is None or tg is None or depth > 2 or len(tp[1]) != len(tg[1]):
            return False
        if tp[0] != tg[0] and "" not in (tp[0], tg[0]):
            return False
        if tp[0] == tg[0] == "\\{":  # a set: every element matched once, in any order
            left = list(tg[1])
            for a in tp[1]:
                hit = next((i for i, b in enumerate(left) if answers_match(a, b, depth + 1)), None)
                if hit is None:
                    return False
                left.pop(hit)
            return True
        return all(answers_match(a, b, depth + 1) for a, b in zip(tp[1], tg[1]))
    return _expressions_match(pred, gold)


# --- format and rewards ----------------------------------------------------------------------------------------------

_THINK = re.compile(r"<think>(.*?)</think>(.*)", re.S)
_TAG_SPACE = re.compile(r"\s*(<|>|/)\s*")


def format_ok(completion: Any, strict: bool = False) -> bool:
    """Whether a completion has the answer format, ``<think>...</think> ... \\boxed{...}``.

    Default, the seed's check (SHENZHEBEI/EvolvedGRPO@2dffc532, ``EasyR1/examples/score_function/math.py``,
    ``compute_score`` then ``format_reward``): whitespace around every ``<``, ``>`` and ``/`` removed, then the whole
    text must read ``<think>``, anything, ``</think>``, anything, ``\\boxed{``, anything, ``}``, anything (the regex
    ``<think>.*</think>.*\\boxed\\{.*\\}.*``, DOTALL), decided here in one linear pass. So ``< think >`` counts as a
    tag, a second think part passes, and the box's braces need not balance.

    ``strict`` (the project's earlier check): the text (whitespace around it aside) is one think part, no other think
    tag after it, then a closed ``\\boxed{}``."""
    if not strict:
        text = _TAG_SPACE.sub(r"\1", _text(completion))
        if not text.startswith("<think>"):
            return False
        close = text.find("</think>", len("<think>"))  # the earliest of each leaves the most room for the rest
        box = text.find("\\boxed{", close + len("</think>")) if close >= 0 else -1
        return box >= 0 and "}" in text[box + len("\\boxed{") :]
    text = _text(completion).strip()
    m = _THINK.fullmatch(text)
    if m is None or "<think>" in m.group(1) or "<think>" in m.group(2) or "</think>" in m.group(2):
        return False
    return extract_boxed(m.group(2)) is not None


def _per_completion(values: Any, n: int, name: str) -> list[Any]:
    if isinstance(values, (str, int, float)) or values is None:
        return [values] * n
    values = list(values)
    if len(values) != n:
        raise ValueError(f"{name} has {len(values)} entries for {n} completions")
    return values


def accuracy_reward(completions: Sequence[Any], answers: Any, **kwargs: Any) -> list[float]:
    """1.0 when the last ``\\boxed{}`` of the completion :func:`answers_match` its ground-truth answer, else 0.0.

    ``answers``: one per completion, or one for all.
    """
    gold = _per_completion(answers, len(completions), "answers")
    return [1.0 if answers_match(extract_boxed(c), g) else 0.0 for c, g in zip(completions, gold)]


def format_reward(completions: Sequence[Any], strict: bool = False, **kwargs: Any) -> list[float]:
    """1.0 for :func:`format_ok` completions (the seed's check, or with ``strict`` the earlier one), else 0.0."""
    return [1.0 if format_ok(c, strict) else 0.0 for c in completions]


def answer_reward(completions: Sequence[Any], answers: Any, format_weight: float = 0.1, **kwargs: Any) -> list[float]:
    """The answer model's reward, ``(1 - w) * accuracy + w * format`` with ``w = format_weight`` (the seed: 0.1)."""
    if not 0.0 <= format_weight <= 1.0:
        raise ValueError(f"format_weight must be in [0, 1], got {format_weight!r}")
    acc = accuracy_reward(completions, answers)
    fmt = format_reward(completions)
    return [(1.0 - format_weight) * a + format_weight * f for a, f in zip(acc, fmt)]
