"""PieceTable.memo: objects derived from a table (device copies, plans) are built once per key and
kept with the table, a bounded number per kind."""
from __future__ import annotations

from megatron_opt.ops.piece_table import PieceTable, full_table


def test_memo_builds_once_per_key_and_evicts_the_oldest():
    table = full_table(64)
    built = []

    def build(key):
        return lambda: (built.append(key), object())[1]

    first = table.memo("plans", "a", build("a"), max_entries=2)
    assert table.memo("plans", "a", build("a"), max_entries=2) is first and built == ["a"]
    table.memo("plans", "b", build("b"), max_entries=2)
    table.memo("plans", "c", build("c"), max_entries=2)  # evicts "a", the oldest
    assert table.memo("plans", "b", build("b"), max_entries=2) is not None and built == ["a", "b", "c"]
    assert table.memo("plans", "a", build("a"), max_entries=2) is not first and built == ["a", "b", "c", "a"]
    table.memo("other", "a", build("other"))  # kinds do not share keys or bounds
    assert built[-1] == "other"


def test_memo_is_not_part_of_equality():
    a, b = full_table(8), full_table(8)
    a.memo("plans", 1, lambda: 1)
    assert a == b and PieceTable((0,), (8,), (True,), (0,), 8) == a
