"""Final-answer extraction and equivalence for the ``math`` environment.

Models write the same number many ways (``3/4``, ``0.75``, ``\\frac{3}{4}``, ``\\dfrac34``,
``1,000``, ``x = 5``, ``50\\%``), so a string compare would punish correct answers and teach the
policy formatting instead of maths. We translate a small, well-defined subset of LaTeX into a
sympy expression and compare values. The text comes from the model, so the translation is
whitelist-based (never ``eval`` of arbitrary text) and guarded against expressions whose
evaluation would blow up (``9^{9^{9^9}}``).
"""

from __future__ import annotations

import re
from typing import Any

import sympy
from sympy.parsing.sympy_parser import (
    implicit_multiplication_application,
    parse_expr,
    rationalize,
    standard_transformations,
)

MAX_ANSWER_CHARS = 400
"""Longer "answers" are compared as text only; no real final answer is this long."""

_FUNCTIONS: dict[str, Any] = {
    "sqrt": sympy.sqrt, "log": sympy.log, "sin": sympy.sin, "cos": sympy.cos,
    "tan": sympy.tan, "exp": sympy.exp, "Abs": sympy.Abs,
}
_CONSTANTS: dict[str, Any] = {"pi": sympy.pi, "oo": sympy.oo, "E": sympy.E}
_PARSER_NAMES: dict[str, Any] = {
    "Symbol": sympy.Symbol, "Integer": sympy.Integer, "Float": sympy.Float,
    "Rational": sympy.Rational, "Tuple": sympy.Tuple, "Function": sympy.Function,
    "Add": sympy.Add, "Mul": sympy.Mul, "Pow": sympy.Pow,
    **_FUNCTIONS, **_CONSTANTS,
}
_TRANSFORMS = (*standard_transformations, implicit_multiplication_application, rationalize)

_SAFE_CHARS = re.compile(r"^[0-9A-Za-z+\-*/().,\s]*$")
_IDENT = re.compile(r"[A-Za-z]+")
_THOUSANDS = re.compile(r"(?<![\d.])(\d{1,3}(?:,\d{3})+)(?![\d,]|\.\d*,)")
_ASSIGNMENT = re.compile(r"^\s*[A-Za-z]\w*\s*=\s*(?!=)")
_LATEX_WORDS = {
    r"\pi": " pi ", r"\infty": " oo ", r"\cdot": "*", r"\times": "*", r"\div": "/",
    r"\ln": " log ", r"\log": " log ", r"\sin": " sin ", r"\cos": " cos ", r"\tan": " tan ",
    r"\exp": " exp ",
}
_SPACING = (r"\left", r"\right", r"\displaystyle", r"\!", r"\,", r"\;", r"\:", r"\quad",
            r"\qquad", r"\ ", "~", "$", r"\(", r"\)", r"\[", r"\]")


def find_closing(text: str, open_index: int) -> int:
    """Index of the ``}`` matching the ``{`` at ``open_index``, or -1 when unbalanced."""
    depth = 0
    for i in range(open_index, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return i
    return -1


def extract_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) in ``text``, if any."""
    best: str | None = None
    for match in re.finditer(r"\\(?:boxed|fbox)\s*(\{)?", text):
        if match.group(1) is None:  # "\boxed 5": the argument is the next token
            token = re.match(r"\s*([^\s$]+)", text[match.end():])
            if token:
                best = token.group(1)
            continue
        end = find_closing(text, match.start(1))
        if end != -1:
            best = text[match.start(1) + 1:end]
    return best.strip() if best is not None else None


_STATED = re.compile(r"(?i)\b(?:final\s+)?answer\s*(?:is|:|=)\s*:?\s*(.+?)\s*$")


def extract_stated_answer(text: str) -> str | None:
    """The answer of the last line that states one ("The answer is 43.", "Final answer: 3/4"),
    GSM8K-style, for models that answer in words instead of ``\\boxed{}``.

    Only a statement that ends its line counts, so "the answer is 4 if x > 2, else 5" gives
    nothing rather than a guess; a sentence's closing period and ``$...$`` math delimiters go.
    """
    for line in reversed(text.splitlines()):
        match = _STATED.search(line)
        if match is None:
            continue
        answer = match.group(1).rstrip(".").strip().strip("$").strip()
        hedged = re.search(r"[,;]\s|\s(?:if|or|and)\s", answer)
        if answer and len(answer) <= MAX_ANSWER_CHARS and not hedged:
            return answer
        return None
    return None


def _unwrap_command(text: str, command: str, keep: bool) -> str:
    """Replace ``\\command{X}`` by ``X`` (keep) or by nothing."""
    while True:
        i = text.find(command + "{")
        if i == -1:
            return text
        open_i = i + len(command)
        end = find_closing(text, open_i)
        if end == -1:
            return text[:i] + text[open_i + 1:]
        inner = text[open_i + 1:end] if keep else " "
        text = text[:i] + inner + text[end + 1:]


def _braced_arg(text: str, start: int) -> tuple[str, int] | None:
    """The LaTeX argument at ``start``: a ``{...}`` group or a single character."""
    while start < len(text) and text[start] == " ":
        start += 1
    if start >= len(text):
        return None
    if text[start] == "{":
        end = find_closing(text, start)
        if end == -1:
            return None
        return text[start + 1:end], end + 1
    if text[start] == "\\":
        word = re.match(r"\\[A-Za-z]+", text[start:])
        if word:
            return word.group(0), start + len(word.group(0))
    return text[start], start + 1


def _expand_fracs_and_roots(text: str) -> str:
    """``\\frac{a}{b}`` → ``((a)/(b))``, ``\\sqrt[n]{x}`` → ``((x)**(1/(n)))``, ``\\sqrt{x}``."""
    for _ in range(200):  # each pass rewrites the first command; nesting is handled by repeats
        m = re.search(r"\\(frac|sqrt)", text)
        if m is None:
            return text
        pos = m.end()
        if m.group(1) == "frac":
            num = _braced_arg(text, pos)
            den = _braced_arg(text, num[1]) if num else None
            if num is None or den is None:
                return text
            text = f"{text[:m.start()]}(({num[0]})/({den[0]})){text[den[1]:]}"
            continue
        index = None
        if pos < len(text) and text[pos] == "[":
            close = text.find("]", pos)
            if close == -1:
                return text
            index, pos = text[pos + 1:close], close + 1
        arg = _braced_arg(text, pos)
        if arg is None:
            return text
        repl = f"sqrt({arg[0]})" if index is None else f"(({arg[0]})**(1/({index})))"
        text = f"{text[:m.start()]}{repl}{text[arg[1]:]}"
    return text


def normalize_answer(answer: str) -> str:
    """Canonical text of an answer: LaTeX decorations, units and spacing removed.

    Also the fallback comparison for answers that are not expressions (``yes``, ``(a)``).
    """
    text = answer.strip()
    boxed = extract_boxed(text)
    if boxed is not None:
        text = boxed
    for word in (r"\dfrac", r"\tfrac"):
        text = text.replace(word, r"\frac")
    text = text.replace("{,}", "").replace(r"\%", "%").replace("°", "")
    text = re.sub(r"\^\s*\{?\\circ\}?", "", text)
    for space in _SPACING:
        text = text.replace(space, " ")
    for command in (r"\mathrm", r"\textbf", r"\mathbf", r"\mbox"):
        text = _unwrap_command(text, command, keep=True)
    without_text = _unwrap_command(text, r"\text", keep=False)
    # "5 \text{cm}" is the number 5; "\text{yes}" alone is the word yes.
    text = without_text if without_text.strip() else _unwrap_command(text, r"\text", keep=True)
    text = _ASSIGNMENT.sub("", text)
    text = re.sub(r"\s+", " ", text).strip().rstrip(".").strip()
    return text


def _to_sympy_source(text: str) -> str | None:
    """Translate normalized LaTeX to sympy source, or None when it is not in our subset."""
    text = _expand_fracs_and_roots(text)
    for word, repl in sorted(_LATEX_WORDS.items(), key=lambda kv: -len(kv[0])):
        text = re.sub(re.escape(word) + r"(?![A-Za-z])", repl, text)
    if "\\" in text:
        return None
    text = text.replace("{", "(").replace("}", ")").replace("[", "(").replace("]", ")")
    text = text.replace("^", "**")
    text = _THOUSANDS.sub(lambda m: m.group(1).replace(",", ""), text)
    text = re.sub(r"(?<![A-Za-z])e(?![A-Za-z])", "E", text)
    text = re.sub(r"(?<![A-Za-z])abs(?![A-Za-z])", "Abs", text)
    if not _SAFE_CHARS.match(text.replace("**", "*")):
        return None
    for ident in _IDENT.findall(text):
        if ident not in _PARSER_NAMES and len(ident) > 1:
            return None  # words are text answers, not products of single-letter symbols
    return text.strip() or None


def _is_safe(expr: sympy.Basic) -> bool:
    """Reject expressions whose evaluation could take unbounded time or memory."""
    for node in sympy.preorder_traversal(expr):
        if isinstance(node, sympy.Integer) and abs(int(node)) > 10**60:
            return False
        if isinstance(node, sympy.Pow):
            exponent = node.exp
            if not exponent.is_number or abs(complex(exponent.evalf(5))) > 1000:
                return False
            # a tower multiplies exponents; reciprocals and roots of a power are harmless
            if isinstance(node.base, sympy.Pow) and abs(complex(exponent.evalf(5))) > 1:
                return False
    return True


def parse_answer(answer: str) -> sympy.Basic | None:
    """The answer as a sympy value (number, expression or tuple), or None if it is not one."""
    text = normalize_answer(answer).replace("%", "")
    if not text or len(text) > MAX_ANSWER_CHARS:
        return None
    source = _to_sympy_source(text)
    if source is None:
        return None
    try:
        raw = parse_expr(source, local_dict={}, global_dict=dict(_PARSER_NAMES),
                         transformations=_TRANSFORMS, evaluate=False)
        if not _is_safe(raw):
            return None
        value = parse_expr(source, local_dict={}, global_dict=dict(_PARSER_NAMES),
                           transformations=_TRANSFORMS)
    except Exception:  # any parse failure means "not an expression"; fall back to text
        return None
    if isinstance(value, tuple):
        value = sympy.Tuple(*value)
    return value if isinstance(value, sympy.Basic) else None


def _values_equal(a: sympy.Basic, b: sympy.Basic, rel_tol: float) -> bool:
    if isinstance(a, sympy.Tuple) or isinstance(b, sympy.Tuple):
        return (isinstance(a, sympy.Tuple) and isinstance(b, sympy.Tuple) and len(a) == len(b)
                and all(_values_equal(x, y, rel_tol) for x, y in zip(a, b, strict=True)))
    if not isinstance(a, sympy.Expr) or not isinstance(b, sympy.Expr):
        return bool(a == b)
    if a == b:
        return True
    if a.is_Rational and b.is_Rational:
        return False  # exact values (decimals were rationalized): no tolerance, 10**9 != 10**9+1
    if a.free_symbols or b.free_symbols:
        return _agree_at_sample_points(a, b, rel_tol)
    try:
        if not (a.is_finite and b.is_finite):
            return False
        va, vb = complex(sympy.N(a, 30)), complex(sympy.N(b, 30))
    except (TypeError, ValueError, ArithmeticError):
        return False
    return abs(va - vb) <= rel_tol * max(1.0, abs(vb))


_SAMPLE_POINTS = (0.3183, 0.7071, 1.4142, 2.7183)


def _agree_at_sample_points(a: sympy.Expr, b: sympy.Expr, rel_tol: float) -> bool:
    """Symbolic answers agree when they agree numerically at a few fixed points.

    ``simplify(a - b)`` would be exact but can run for minutes on what a model writes
    (``\\sin(x)^{999}``); two distinct answer expressions agreeing at several unrelated
    irrational-ish points is not a risk worth that.
    """
    symbols = sorted(a.free_symbols | b.free_symbols, key=str)
    checked = 0
    for shift, _ in enumerate(_SAMPLE_POINTS):
        point = {s: _SAMPLE_POINTS[(shift + i) % len(_SAMPLE_POINTS)] + 0.1 * i
                 for i, s in enumerate(symbols)}
        try:
            va, vb = complex(a.evalf(30, subs=point)), complex(b.evalf(30, subs=point))
        except (TypeError, ValueError, ArithmeticError):
            continue
        if not all(map(_finite, (va, vb))):
            continue
        if abs(va - vb) > max(rel_tol, 1e-12) * max(1.0, abs(vb)):
            return False
        checked += 1
    return checked >= 2


def _finite(z: complex) -> bool:
    return all(abs(part) < float("inf") and part == part for part in (z.real, z.imag))


def answers_equivalent(predicted: str | None, gold: str, *, rel_tol: float = 1e-9) -> bool:
    """True when ``predicted`` denotes the same answer as ``gold``.

    Numbers compare by value (``0.75 == 3/4 == \\frac{3}{4}``, ``1,000 == 1000``): exactly when
    both are rational (decimals are read as exact fractions), within ``rel_tol`` when one is
    irrational (``2\\pi`` vs ``6.283185307179586``); symbolic
    answers compare by value at a few sample points; tuples element-wise; anything else by its
    normalized text (case-insensitive). A percentage equals both its number and its fraction
    (``50%`` matches ``50`` and ``0.5``), because problems rarely say which they want.
    """
    if predicted is None or not predicted.strip():
        return False
    gold_value = parse_answer(gold)
    pred_value = parse_answer(predicted)
    if gold_value is not None and pred_value is not None:
        if _values_equal(pred_value, gold_value, rel_tol):
            return True
        if "%" in normalize_answer(predicted) and isinstance(pred_value, sympy.Expr):
            return _values_equal(pred_value / 100, gold_value, rel_tol)
        if "%" in normalize_answer(gold) and isinstance(gold_value, sympy.Expr):
            return _values_equal(pred_value, gold_value / 100, rel_tol)
        return False
    squash = lambda s: re.sub(r"\s+", "", normalize_answer(s)).lower()  # noqa: E731
    return squash(predicted) == squash(gold)
