"""Label and field selectors as the Kubernetes API server parses them (the subset we need).

Label selectors: `a=b`, `a==b`, `a!=b`, `a`, `!a`, `a in (x,y)`, `a notin (x,y)`, joined by
commas. Field selectors: `path.to.field=value` / `!=`, joined by commas.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

Predicate = Callable[[Mapping[str, str]], bool]

_SET_RE = re.compile(r"^\s*([^\s!=]+)\s+(in|notin)\s+\((.*)\)\s*$")


class SelectorError(ValueError):
    """A selector the fake server cannot parse (answered with 400 Bad Request)."""


def _split_terms(text: str) -> list[str]:
    """Split on commas that are not inside parentheses."""
    terms, depth, current = [], 0, []
    for ch in text:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        if ch == "," and depth == 0:
            terms.append("".join(current))
            current = []
        else:
            current.append(ch)
    terms.append("".join(current))
    return [t.strip() for t in terms if t.strip()]


def parse_label_selector(text: str | None) -> Predicate:
    """A predicate over an object's labels; an empty selector matches everything."""
    preds: list[Predicate] = []
    for term in _split_terms(text or ""):
        m = _SET_RE.match(term)
        if m:
            key, op, values = m.group(1), m.group(2), {v.strip() for v in m.group(3).split(",")}
            if op == "in":
                preds.append(lambda labels, k=key, vs=values: labels.get(k) in vs)
            else:
                preds.append(lambda labels, k=key, vs=values: labels.get(k) not in vs)
        elif "!=" in term:
            key, value = (s.strip() for s in term.split("!=", 1))
            preds.append(lambda labels, k=key, v=value: labels.get(k) != v)
        elif "=" in term:
            key, value = (s.strip() for s in term.replace("==", "=").split("=", 1))
            preds.append(lambda labels, k=key, v=value: labels.get(k) == v)
        elif term.startswith("!"):
            preds.append(lambda labels, k=term[1:].strip(): k not in labels)
        elif re.match(r"^[A-Za-z0-9./_-]+$", term):
            preds.append(lambda labels, k=term: k in labels)
        else:
            raise SelectorError(f"unable to parse requirement: {term!r}")
    return lambda labels: all(p(labels) for p in preds)


def _field(obj: Mapping[str, Any], path: str) -> str:
    value: Any = obj
    for part in path.split("."):
        if not isinstance(value, Mapping):
            return ""
        value = value.get(part)
    return "" if value is None else str(value)


def parse_field_selector(text: str | None) -> Callable[[Mapping[str, Any]], bool]:
    """A predicate over a whole object, for `metadata.name=x,involvedObject.name=y`."""
    preds: list[Callable[[Mapping[str, Any]], bool]] = []
    for term in _split_terms(text or ""):
        if "!=" in term:
            path, value = (s.strip() for s in term.split("!=", 1))
            preds.append(lambda o, p=path, v=value: _field(o, p) != v)
        elif "=" in term:
            path, value = (s.strip() for s in term.replace("==", "=").split("=", 1))
            preds.append(lambda o, p=path, v=value: _field(o, p) == v)
        else:
            raise SelectorError(f"invalid field selector: {term!r}")
    return lambda obj: all(p(obj) for p in preds)
