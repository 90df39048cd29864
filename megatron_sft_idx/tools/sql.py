"""SQL over shards without converting them: DuckDB reading a :class:`~.arrow.PackTable`.

    from megatron_sft_idx.tools.sql import query
    query("/data/train_*", "SELECT num_sequences, count(*) AS packs FROM packs GROUP BY 1 ORDER BY 1")

The tables are ``packs`` (one row per pack) and ``sequences`` (one per sequence, with its source for
shards written from a mixture: ``SELECT source, sum(trainable_tokens) FROM sequences GROUP BY 1``);
columns in :mod:`.arrow`. Only the tables and columns a query names are produced:
``trainable_tokens`` costs a pass over the loss mask, the list columns cost nothing until the
engine reads them. DuckDB is an optional dependency (extra ``[tools]``).
"""

from __future__ import annotations

import re
from typing import Optional, Sequence, Tuple

from .._extras import require_extra
from ..errors import QueryError
from .arrow import COLUMNS, SEQUENCE_COLUMNS, PackTable, SequenceTable

TABLE = "packs"
SEQUENCES = "sequences"
_COUNT_STAR = re.compile(r"count\s*\(\s*\*\s*\)", re.IGNORECASE)


def columns_for_query(sql: str, columns: Sequence[str] = COLUMNS, least: str = "pack") -> Tuple[str, ...]:
    """The ``columns`` a query may read: every column named in it, or all of them when it has a
    ``*`` other than ``count(*)`` (a string literal naming a column only costs that column)."""
    if "*" in _COUNT_STAR.sub("", sql):
        return tuple(columns)
    named = tuple(c for c in columns if re.search(rf"\b{c}\b", sql, re.IGNORECASE))
    return named or (least,)


def _connect(spec, sql: str, columns: Optional[Sequence[str]]):
    require_extra("tools", "duckdb")
    import duckdb

    con = duckdb.connect()
    tables = []
    if columns is not None or re.search(rf"\b{TABLE}\b", sql, re.IGNORECASE) or \
            not re.search(rf"\b{SEQUENCES}\b", sql, re.IGNORECASE):
        tables.append(PackTable(spec, columns=columns or columns_for_query(sql)))
        con.register(TABLE, tables[-1])
    if re.search(rf"\b{SEQUENCES}\b", sql, re.IGNORECASE):   # (only when the query names it)
        tables.append(SequenceTable(spec, columns=columns_for_query(sql, SEQUENCE_COLUMNS)))
        con.register(SEQUENCES, tables[-1])
    return duckdb, con, _Tables(tables)


class _Tables:
    """The tables of one query, as :func:`_failed` asks them for a failure."""

    def __init__(self, tables) -> None:
        self.tables = tables

    @property
    def failure(self):
        return next((t.failure for t in self.tables if t.failure is not None), None)


def _failed(exc: Exception, table: PackTable, sql: str) -> BaseException:
    """The error to raise for a failed query: the shard's own error when reading a shard failed
    under the engine (DuckDB would print it with an embedded traceback), else a QueryError
    carrying only the engine's first line."""
    if table.failure is not None:
        return table.failure
    message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return QueryError(f"the query failed: {message}", field="sql", actual=sql)


def query(spec, sql: str, *, columns: Optional[Sequence[str]] = None):
    """Run ``sql`` over the tables ``packs`` and ``sequences`` of ``spec``'s shards; return a
    ``pyarrow.Table`` (``columns``: those of ``packs`` to produce, default the ones ``sql`` names).

    Raises:
        QueryError: DuckDB refused or failed the query (its message's first line).
        MissingExtraError: duckdb is not installed (extra ``tools``).
        ShardError (any subclass): a shard is missing, unreadable or corrupt (also when the
            engine found it so while reading: the shard's own error, not the engine's).
    """
    duckdb, con, table = _connect(spec, sql, columns)
    try:
        result = con.sql(sql)
        # duckdb 2 renamed fetch_arrow_table (deprecated there); 1.x has only the old name
        return result.to_arrow_table() if hasattr(result, "to_arrow_table") else result.fetch_arrow_table()
    except duckdb.Error as exc:
        raise _failed(exc, table, sql) from None
    finally:
        con.close()


def query_text(spec, sql: str, *, max_rows: int = 40, max_width: int = 160) -> str:
    """The query's result rendered as DuckDB's text table (for people)."""
    duckdb, con, table = _connect(spec, sql, None)
    try:
        relation = con.sql(sql)
        if relation is None:  # a statement without a result
            return ""
        return _render(relation, max_rows, max_width)
    except duckdb.Error as exc:
        raise _failed(exc, table, sql) from None
    finally:
        con.close()


def _render(relation, max_rows: int, max_width: int) -> str:
    """DuckDB's own table rendering (it prints; captured here)."""
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        relation.show(max_rows=max_rows, max_width=max_width)
    return out.getvalue().rstrip("\n")
