"""``--where``: a row filter on the input's metadata columns (LAION's ``aesthetic``, ``punsafe``,
``pwatermark``, ``similarity``, ``WIDTH``/``HEIGHT``, ``LANGUAGE``), applied as the parquet is read, before
any image is decoded.

The expression is parsed by a small grammar of its own (never Python's ``eval``) into a pyarrow compute
expression::

    expr    := term ("or" term)*              # lowest precedence
    term    := factor ("and" factor)*
    factor  := "not" factor | "(" expr ")" | test
    test    := COLUMN OP VALUE                # OP: == = != < <= > >=; VALUE: a number or a 'quoted' string
             | COLUMN ["not"] "in" "[" VALUE ("," VALUE)* "]"
             | COLUMN "is" ["not"] "null"

Keywords are case-insensitive; a column name is a bare word (letters, digits, ``_``, ``.``) or a
``"double-quoted"`` one; a string value is quoted either way (``LANGUAGE in ['en', "de"]``). A comparison with a missing value (null) fails, as in SQL, so ``punsafe < 0.1``
drops rows without a ``punsafe``; ``punsafe is null or punsafe < 0.1`` keeps them.

Each top-level ``and`` term is a *rule*: a dropped row is blamed on the first rule it fails, in the
order written, and counted under the reject reason ``filtered: <rule>`` (:meth:`RowFilter.blame`), so
the summary says how many rows each rule removed.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re

from diffusion.errors import ConfigError

FILTERED = "filtered"  # reject reasons: "filtered: <rule>"
MAX_DEPTH = 100  # parentheses and "not" nested deeper are refused (the parser and pyarrow recurse on them)
MAX_TESTS = 1000  # comparisons in one filter (pyarrow evaluates a chain of thousands by recursion, and crashes)
_TOKEN = re.compile(r"""\s*(?:(?P<number>[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)(?![\w.])
                          |'(?P<string>(?:[^'\\]|\\.)*)'
                          |"(?P<quoted>(?:[^"\\]|\\.)*)"
                          |(?P<op>==|!=|<=|>=|=|<|>|\(|\)|\[|\]|,)
                          |(?P<word>[A-Za-z_][\w.]*))""", re.VERBOSE)
_KEYWORDS = {"and", "or", "not", "in", "is", "null"}
_OPS = {"==": "==", "=": "==", "!=": "!=", "<": "<", "<=": "<=", ">": ">", ">=": ">="}


class FilterSyntaxError(ConfigError):
    """A ``--where`` that does not parse; the message shows the expression and where it went wrong."""


def _tokens(text: str) -> list[tuple[str, object]]:
    tokens, pos = [], 0
    text = text.rstrip()
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if not m or m.end() == pos:
            raise _error(text, f"unexpected {text[pos:].strip()[:20]!r}")
        pos = m.end()
        kind = m.lastgroup
        value = m.group(kind)
        if kind == "number":
            value = float(value) if any(c in value for c in ".eE") else int(value)
            if isinstance(value, float) and not math.isfinite(value):
                raise _error(text, f"the number {m.group(kind)} is out of range of a 64-bit float")
            if isinstance(value, int) and not -2**63 <= value < 2**63:
                digits = m.group(kind).lstrip("+-")
                shown = digits if len(digits) <= 24 else f"{digits[:20]}... ({len(digits)} digits)"
                raise _error(text, f"the integer {shown} is out of range (a 64-bit integer has at most 19 digits; "
                                   f"write a larger number as a float, e.g. 1e30)")
        elif kind in ("string", "quoted"):
            value = re.sub(r"\\(.)", r"\1", value)
        elif kind == "word" and value.lower() in _KEYWORDS:
            kind, value = "keyword", value.lower()
        tokens.append((kind, value))
    return tokens


_SHOWN = 160  # characters of a long expression shown in an error


def _shown(text: str) -> str:
    """``text`` quoted, shortened in the middle if long (an error stays one readable line)."""
    if len(text) <= _SHOWN:
        return repr(text)
    return f"{text[:_SHOWN // 2]!r} ... {text[-_SHOWN // 4:]!r} ({len(text)} characters)"


def _error(text: str, why: str) -> FilterSyntaxError:
    return FilterSyntaxError(f"--where {_shown(text)} is not a filter expression: {why} (expected e.g. "
                             f"\"aesthetic >= 5.0 and punsafe < 0.1\"; comparisons, and, or, not, "
                             f"parentheses, in [...], is null)")


def _literal(value) -> str:
    return repr(value) if isinstance(value, str) else str(value)


def _name(column: str) -> str:
    return column if re.fullmatch(r"[A-Za-z_][\w.]*", column) and column.lower() not in _KEYWORDS else f'"{column}"'


class _Parser:
    """Recursive descent over the tokens; each rule returns (pyarrow expression, canonical text, columns)."""

    def __init__(self, text: str):
        self.text, self.tokens, self.i, self.depth, self.tests = text, _tokens(text), 0, 0, 0

    def peek(self, kind=None, value=None) -> bool:
        if self.i >= len(self.tokens):
            return False
        k, v = self.tokens[self.i]
        return (kind is None or k == kind) and (value is None or v == value)

    def take(self, kind=None, value=None, what=""):
        if not self.peek(kind, value):
            found = repr(self.tokens[self.i][1]) if self.i < len(self.tokens) else "the end"
            raise _error(self.text, f"expected {what or value or kind}, found {found}")
        self.i += 1
        return self.tokens[self.i - 1][1]

    def terms(self) -> list[tuple]:
        """The top-level ``and`` terms; the whole expression if it is an ``or`` at the top."""
        terms = [self.conjunct_or_expr()]
        if self.i < len(self.tokens):
            raise _error(self.text, f"unexpected {self.tokens[self.i][1]!r}")
        return terms[0]

    def conjunct_or_expr(self) -> list[tuple]:
        first = self.factors()
        if not self.peek("keyword", "or"):
            return first
        parts = [_conjoin(first)]
        while self.peek("keyword", "or"):
            self.i += 1
            parts.append(_conjoin(self.factors()))
        return [_disjoin(parts)]

    def expr(self) -> tuple:
        terms = self.conjunct_or_expr()
        return _conjoin(terms)

    def factors(self) -> list[tuple]:
        factors = [self.factor()]
        while self.peek("keyword", "and"):
            self.i += 1
            factors.append(self.factor())
        return factors

    def factor(self) -> tuple:
        if self.peek("keyword", "not") or self.peek("op", "("):
            self.depth += 1
            if self.depth > MAX_DEPTH:
                raise _error(self.text, f"parentheses and 'not' are nested more than {MAX_DEPTH} deep")
            try:
                if self.peek("keyword", "not"):
                    self.i += 1
                    expr, text, cols = self.factor()
                    return ~expr, f"not {text}", cols
                self.i += 1
                expr, text, cols = self.expr()
                self.take("op", ")", "')'")
                return expr, f"({text})", cols
            finally:
                self.depth -= 1
        return self.test()

    def value(self):
        if self.peek("number") or self.peek("string") or self.peek("quoted"):
            return self.take()
        raise _error(self.text, "expected a number or a 'quoted' string"
                     + (f", found {self.tokens[self.i][1]!r}" if self.i < len(self.tokens) else " at the end"))

    def test(self) -> tuple:
        import pyarrow.compute as pc
        self.tests += 1
        if self.tests > MAX_TESTS:
            raise _error(self.text, f"it makes more than {MAX_TESTS} comparisons (test many values with in [...])")
        column = self.take("quoted") if self.peek("quoted") else self.take("word", what="a column name")
        field = pc.field(column)
        if self.peek("keyword", "is"):
            self.i += 1
            negate = self.peek("keyword", "not")
            self.i += negate
            self.take("keyword", "null", "'null'")
            expr = field.is_valid() if negate else field.is_null()
            return expr, f"{_name(column)} is {'not ' * negate}null", {column}
        negate = self.peek("keyword", "not")
        if negate:
            self.i += 1
        if self.peek("keyword", "in"):
            self.i += 1
            self.take("op", "[", "'['")
            values = [self.value()]
            while self.peek("op", ","):
                self.i += 1
                values.append(self.value())
            self.take("op", "]", "']'")
            if len({isinstance(v, str) for v in values}) > 1:
                raise _error(self.text, f"the values of {column} {'not ' * negate}in [...] mix numbers and strings "
                                        f"({', '.join(map(_literal, values))}): a column holds one or the other")
            expr = _built(self.text, lambda: field.isin(values))
            text = f"{_name(column)} {'not ' * negate}in [{', '.join(map(_literal, values))}]"
            return (~expr if negate else expr), text, {column}
        if negate:
            raise _error(self.text, f"expected 'in' after {column} not")
        if not self.peek("op") or self.tokens[self.i][1] not in _OPS:
            found = repr(self.tokens[self.i][1]) if self.i < len(self.tokens) else "the end"
            raise _error(self.text, f"expected a comparison after {column}, found {found}")
        op = _OPS[self.take()]
        value = self.value()
        compare = {"==": field.__eq__, "!=": field.__ne__, "<": field.__lt__, "<=": field.__le__,
                   ">": field.__gt__, ">=": field.__ge__}[op]
        expr = _built(self.text, lambda: compare(value))
        return expr, f"{_name(column)} {op} {_literal(value)}", {column}


def _built(text: str, build):
    """A pyarrow expression from ``build()``, or the one-line error of a value pyarrow cannot take."""
    import pyarrow as pa
    try:
        return build()
    except (pa.ArrowException, TypeError, ValueError, OverflowError) as e:
        raise _error(text, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else 'bad value'}") from None


def _conjoin(parts: list[tuple]) -> tuple:
    expr, texts, cols = parts[0][0], [parts[0][1]], set(parts[0][2])
    for e, t, c in parts[1:]:
        expr, cols = expr & e, cols | c
        texts.append(t)
    return expr, " and ".join(texts), cols


def _disjoin(parts: list[tuple]) -> tuple:
    expr, texts, cols = parts[0][0], [parts[0][1]], set(parts[0][2])
    for e, t, c in parts[1:]:
        expr, cols = expr | e, cols | c
        texts.append(t)
    return expr, " or ".join(texts), cols


@dataclasses.dataclass(frozen=True)
class RowFilter:
    """A parsed ``--where``: its rules (top-level ``and`` terms), each a (canonical text, expression)."""

    text: str  # canonical: the same filter written with other spacing or case of keywords reads the same
    rules: tuple
    columns: tuple[str, ...]

    def reason(self, rule: int) -> str:
        """The reject reason of rows that fail ``rule`` first."""
        return f"{FILTERED}: {self.rules[rule][0]}"

    def blame(self, table) -> list[int | None]:
        """Per row of ``table`` (a pyarrow Table or RecordBatch holding :attr:`columns`): None if it
        passes, else the index of the first rule it fails (a null result fails)."""
        import pyarrow as pa
        import pyarrow.compute as pc
        import pyarrow.dataset as ds
        if isinstance(table, pa.RecordBatch):
            table = pa.Table.from_batches([table])
        results = ds.dataset(table.select(list(self.columns))).to_table(
            columns={str(i): expr for i, (_, expr) in enumerate(self.rules)})
        verdict: list[int | None] = [None] * table.num_rows
        for i in range(len(self.rules)):
            passed = pc.fill_null(results.column(i), False).to_pylist()
            for row, ok in enumerate(passed):
                if not ok and verdict[row] is None:
                    verdict[row] = i
        return verdict

    def check_columns(self, names, where: str) -> None:
        """ConfigError naming the columns of ``where`` (a file) if the filter asks for others, or
        compares a column with a value of another type."""
        missing = [c for c in self.columns if c not in names]
        if missing:
            raise ConfigError(f"--where {self.text!r} names column{'s' * (len(missing) > 1)} "
                              f"{', '.join(map(repr, missing))} that {where} does not have; its columns are "
                              f"{', '.join(names)}")

    def check_types(self, arrow_schema, where: str) -> None:
        """ConfigError if a rule cannot be evaluated on ``arrow_schema`` (a number compared with text)."""
        import pyarrow as pa
        try:
            self.blame(pa.schema([arrow_schema.field(c) for c in self.columns]).empty_table())
        except (pa.ArrowNotImplementedError, pa.ArrowInvalid, pa.ArrowTypeError) as e:
            types = ", ".join(f"{c}: {arrow_schema.field(c).type}" for c in self.columns)
            raise ConfigError(f"--where {self.text!r} cannot be evaluated on {where} ({types}): "
                              f"{str(e).splitlines()[0]}") from None


@functools.lru_cache(maxsize=16)
def parse_where(text: str) -> RowFilter:
    """``text`` as a :class:`RowFilter`; :class:`FilterSyntaxError` (one line, showing it) if malformed."""
    if not text or not text.strip():
        raise _error(text or "", "it is empty")
    parser = _Parser(text)
    try:
        rules = parser.terms()
    except RecursionError:  # a long chain pyarrow nests: refused, not a traceback
        raise _error(text, "it is nested too deeply to evaluate") from None
    columns = sorted(set().union(*(cols for _, _, cols in rules)))
    canonical = " and ".join(t for _, t, _ in rules)  # an "or" inside an "and" keeps its parentheses
    return RowFilter(canonical, tuple((t, e) for e, t, _ in rules), tuple(columns))
