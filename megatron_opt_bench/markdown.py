"""Markdown tables of the benchmark reports: a header line, its separator, then the rows."""
from __future__ import annotations

from typing import Iterable


def table(head: str, rows: Iterable[str]) -> str:
    """``head`` (``| a | b |``), the separator with as many columns, then ``rows`` (lines), joined by newlines."""
    return "\n".join([head, "|" + "---|" * (head.count("|") - 1), *rows])


__all__ = ["table"]
