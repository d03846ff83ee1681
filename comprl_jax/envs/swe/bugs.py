"""Procedural bugs for SWE-Lite (issue 32 point 1): small AST-located edits of a Python source file.

:func:`candidates` lists every edit of six kinds inside function bodies, in source order; :func:`apply` makes one.
Edits are text splices at the positions ``ast`` reports, so the rest of the file keeps its formatting and a bug's
patch is a diff of a line or a few lines. Whether an edit is a *task* is decided by running the tests
(``tasks.py``: some test must go from pass to fail, the rest must still pass).

| kind | edit |
|---|---|
| ``op_swap`` | a binary, comparison or boolean operator for its partner (``+``/``-``, ``<``/``<=``, ``==``/``!=``, ``and``/``or``, ``in``/``not in``, ...) |
| ``off_by_one`` | an integer literal in a comparison, a subscript or slice, ``range(...)`` or arithmetic, plus or minus one |
| ``remove_statement`` | one assignment, augmented assignment or call statement of a body that keeps another statement |
| ``remove_return`` | one ``return`` that is not the last statement of its function (an early exit) |
| ``remove_branch`` | one ``if`` without ``else`` (its whole block) from a body that keeps another statement |
| ``swap_args`` | the first two positional arguments of a call, when their texts differ |
| ``wrong_constant`` | ``True``/``False``, ``None`` for ``0``... a literal in a return, an assignment or a default for another |

Shapes: a :class:`Mutation` holds character offsets ``[start, end)`` into the source and the text that replaces
that span (empty for a removal, which spans whole lines).
"""

from __future__ import annotations

import ast
import dataclasses
import difflib

KINDS = (
    "op_swap",
    "off_by_one",
    "remove_statement",
    "remove_return",
    "remove_branch",
    "swap_args",
    "wrong_constant",
)

_BIN = {
    ast.Add: "-",
    ast.Sub: "+",
    ast.Mult: "//",
    ast.FloorDiv: "*",
    ast.Mod: "//",
    ast.LShift: ">>",
    ast.RShift: "<<",
}
_BIN_TEXT = {
    ast.Add: "+",
    ast.Sub: "-",
    ast.Mult: "*",
    ast.FloorDiv: "//",
    ast.Mod: "%",
    ast.LShift: "<<",
    ast.RShift: ">>",
}
_CMP = {ast.Lt: "<=", ast.LtE: "<", ast.Gt: ">=", ast.GtE: ">", ast.Eq: "!=", ast.NotEq: "=="}
_CMP_TEXT = {ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">=", ast.Eq: "==", ast.NotEq: "!="}
_CONST = {True: "False", False: "True"}


@dataclasses.dataclass(frozen=True)
class Mutation:
    kind: str
    start: int  # character offsets into the source
    end: int
    replacement: str
    line: int  # 1-based line of the edit
    function: str  # qualified name of the enclosing function
    before: str  # the replaced text (for the description)

    def describe(self) -> str:
        after = self.replacement.strip() or "<removed>"
        return (
            f"{self.kind} in {self.function} line {self.line}: {self.before.strip()[:60]!r} -> {after[:60]!r}"
        )


class _Offsets:
    """``ast`` positions (1-based line, UTF-8 byte column) to character offsets of the source."""

    def __init__(self, source: str):
        self.text = source
        self.lines = source.splitlines(keepends=True)
        self.starts = [0]
        for ln in self.lines:
            self.starts.append(self.starts[-1] + len(ln))

    def __call__(self, line: int, col_bytes: int) -> int:
        text = self.lines[line - 1] if line - 1 < len(self.lines) else ""
        return self.starts[line - 1] + len(text.encode("utf-8")[:col_bytes].decode("utf-8", errors="ignore"))

    def span(self, node: ast.AST) -> tuple[int, int]:
        return self(node.lineno, node.col_offset), self(node.end_lineno, node.end_col_offset)

    def line_span(self, node: ast.AST) -> tuple[int, int] | None:
        """Whole lines of a statement, or None when it shares a line with other code (``a = 1; b = 2``)."""
        start, end = self.span(node)
        first = self.starts[node.lineno - 1]
        last = self.starts[node.end_lineno]
        after = self.text[end:last].strip()
        if self.text[first:start].strip() or (after and not after.startswith("#")):
            return None
        return first, last


def _functions(tree: ast.AST):
    """(qualified name, FunctionDef) of every function and method, outer first."""
    stack = [("", tree)]
    while stack:
        prefix, node = stack.pop(0)
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{prefix}{child.name}"
                yield name, child
                stack.append((name + ".", child))
            elif isinstance(child, ast.ClassDef):
                stack.append((f"{prefix}{child.name}.", child))


def _own_nodes(fn: ast.AST):
    """Nodes of ``fn``'s body, not descending into nested functions or classes (they are listed on their own)."""
    todo = list(fn.body)
    while todo:
        node = todo.pop(0)
        yield node
        for child in ast.iter_child_nodes(node):
            if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
                todo.append(child)


def _bodies(fn: ast.AST):
    """Every statement list of ``fn`` (its body, branches, loop bodies, with/try blocks), not nested functions."""
    for node in [fn, *_own_nodes(fn)]:
        if node is not fn and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        for field in ("body", "orelse", "finalbody"):
            block = getattr(node, field, None)
            if isinstance(block, list) and block and isinstance(block[0], ast.stmt):
                yield block
        for h in getattr(node, "handlers", []) or []:
            yield h.body


def _is_docstring(block: list, stmt: ast.stmt) -> bool:
    return (
        stmt is block[0]
        and isinstance(stmt, ast.Expr)
        and isinstance(stmt.value, ast.Constant)
        and isinstance(stmt.value.value, str)
    )


def candidates(source: str) -> list[Mutation]:
    """Every edit :data:`KINDS` describe in ``source``'s functions, in source order (deterministic). A source that
    does not parse gives none."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    off = _Offsets(source)
    out: list[Mutation] = []

    def add(kind, start, end, replacement, node, fn):
        before = source[start:end]
        if before != replacement:
            out.append(Mutation(kind, start, end, replacement, node.lineno, fn, before))

    def gap(left: ast.AST, right: ast.AST) -> tuple[int, int]:
        return off(left.end_lineno, left.end_col_offset), off(right.lineno, right.col_offset)

    for name, fn in _functions(tree):
        for c in [*fn.args.defaults, *(d for d in fn.args.kw_defaults if d is not None)]:
            if isinstance(c, ast.Constant) and type(c.value) is bool:  # a default flag flipped
                a, b = off.span(c)
                add("wrong_constant", a, b, _CONST[c.value], c, name)
        for node in _own_nodes(fn):
            # op_swap: the operator token between the operands, replaced in place
            if isinstance(node, ast.BinOp) and type(node.op) in _BIN:
                a, b = gap(node.left, node.right)
                seg = source[a:b]
                tok = _BIN_TEXT[type(node.op)]
                if seg.count(tok) == 1 and "#" not in seg:
                    i = a + seg.index(tok)
                    add("op_swap", i, i + len(tok), _BIN[type(node.op)], node, name)
            elif isinstance(node, ast.Compare):
                left = node.left
                for op, right in zip(node.ops, node.comparators, strict=True):
                    a, b = gap(left, right)
                    seg = source[a:b]
                    if type(op) in _CMP:
                        tok = _CMP_TEXT[type(op)]
                        if seg.strip(" ()\n") == tok:
                            i = a + seg.index(tok)
                            add("op_swap", i, i + len(tok), _CMP[type(op)], node, name)
                    elif isinstance(op, (ast.In, ast.NotIn, ast.Is, ast.IsNot)):
                        words = " ".join(seg.strip(" ()\n").split())
                        swap = {"in": "not in", "not in": "in", "is": "is not", "is not": "is"}.get(words)
                        if swap:
                            i = a + seg.index(seg.strip(" ()\n"))
                            add("op_swap", i, i + len(seg.strip(" ()\n")), swap, node, name)
                    left = right
            elif isinstance(node, ast.BoolOp) and len(node.values) == 2:
                a, b = gap(node.values[0], node.values[1])
                seg = source[a:b]
                tok = "and" if isinstance(node.op, ast.And) else "or"
                if seg.strip(" ()\n") == tok:
                    i = a + seg.index(tok)
                    add("op_swap", i, i + len(tok), "or" if tok == "and" else "and", node, name)
            # off_by_one: integer literals where an index or a bound lives
            if isinstance(node, (ast.Compare, ast.Subscript, ast.Slice, ast.BinOp)) or (
                isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "range"
            ):
                kids = (
                    node.args
                    if isinstance(node, ast.Call)
                    else [node.slice]
                    if isinstance(node, ast.Subscript)
                    else [node.lower, node.upper, node.step]
                    if isinstance(node, ast.Slice)
                    else [node.left, node.right]
                    if isinstance(node, ast.BinOp)
                    else node.comparators
                )
                for k in kids:
                    if isinstance(k, ast.Constant) and type(k.value) is int and k.value >= 0:
                        a, b = off.span(k)
                        if source[a:b].isdigit():
                            for d in (1, -1) if k.value > 0 else (1,):
                                add("off_by_one", a, b, str(k.value + d), k, name)
            # swap_args: the first two positional arguments
            if isinstance(node, ast.Call) and len(node.args) >= 2:
                x, y = node.args[0], node.args[1]
                if not any(isinstance(v, ast.Starred) for v in (x, y)):
                    (xa, xb), (ya, yb) = off.span(x), off.span(y)
                    tx, ty = source[xa:xb], source[ya:yb]
                    mid = source[xb:ya]
                    if tx != ty and mid.strip() == "," and "\n" not in tx + ty:
                        add("swap_args", xa, yb, ty + mid + tx, node, name)
            # wrong_constant: literals returned, assigned or passed as a default
            if isinstance(node, (ast.Return, ast.Assign, ast.keyword)) and isinstance(
                getattr(node, "value", None), ast.Constant
            ):
                c = node.value
                a, b = off.span(c)
                text = source[a:b]
                if type(c.value) is bool:
                    add("wrong_constant", a, b, _CONST[c.value], c, name)
                elif c.value is None and isinstance(node, ast.Return):
                    add("wrong_constant", a, b, "0", c, name)
                elif type(c.value) is int and text.isdigit():
                    add("wrong_constant", a, b, "None" if c.value else "1", c, name)
        # removals: whole statements of a block that keeps another statement
        last = fn.body[-1]
        for block in _bodies(fn):
            real = [s for s in block if not _is_docstring(block, s)]
            if len(real) < 2:
                continue
            for stmt in real:
                kind = None
                if isinstance(stmt, ast.Return) and stmt is not last:
                    kind = "remove_return"
                elif isinstance(stmt, ast.If) and not stmt.orelse:
                    kind = "remove_branch"
                elif isinstance(stmt, (ast.Assign, ast.AugAssign, ast.AnnAssign)) or (
                    isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call)
                ):
                    kind = "remove_statement"
                span = off.line_span(stmt) if kind else None
                if span:
                    add(kind, span[0], span[1], "", stmt, name)
    out.sort(key=lambda m: (m.start, m.end, m.kind, m.replacement))
    return out


def apply(source: str, m: Mutation) -> str:
    """``source`` with ``m`` made."""
    return source[: m.start] + m.replacement + source[m.end :]


def unified_diff(path: str, before: str, after: str) -> str:
    """A ``git apply``/``patch -p1`` diff of one file (``a/PATH`` -> ``b/PATH``)."""
    lines = difflib.unified_diff(
        before.splitlines(keepends=True), after.splitlines(keepends=True), f"a/{path}", f"b/{path}", n=3
    )
    out = []
    for ln in lines:
        out.append(ln if ln.endswith("\n") else ln + "\n\\ No newline at end of file\n")
    return "".join(out)
