"""AST mutations that turn a correct library module into a buggy one, edited in place.

Each mutation rewrites one single-line expression (or deletes one single-line statement) in the
source text, so the diff between buggy and correct code is one small hunk. The edit is checked by
re-parsing: the result must be exactly the mutated syntax tree, or the mutation is dropped.
"""

from __future__ import annotations

import ast
import copy
from collections.abc import Callable, Iterator

import msgspec

_FLIP_COMPARE: dict[type[ast.cmpop], type[ast.cmpop]] = {
    ast.Lt: ast.LtE,
    ast.LtE: ast.Lt,
    ast.Gt: ast.GtE,
    ast.GtE: ast.Gt,
    ast.Eq: ast.NotEq,
    ast.NotEq: ast.Eq,
    ast.In: ast.NotIn,
    ast.NotIn: ast.In,
    ast.Is: ast.IsNot,
    ast.IsNot: ast.Is,
}
_SWAP_OPERATOR: dict[type[ast.operator], type[ast.operator]] = {
    ast.Add: ast.Sub,
    ast.Sub: ast.Add,
    ast.Mult: ast.Add,
    ast.Div: ast.FloorDiv,
    ast.FloorDiv: ast.Div,
    ast.Mod: ast.FloorDiv,
    ast.Pow: ast.Mult,
}
_NON_COMMUTATIVE = (ast.Sub, ast.Div, ast.FloorDiv, ast.Mod, ast.Pow)
_ORDERING = (ast.Lt, ast.LtE, ast.Gt, ast.GtE)
_DROPPABLE = (ast.Assign, ast.AugAssign, ast.Expr, ast.Raise, ast.Return)


class Mutation(msgspec.Struct, frozen=True, kw_only=True):
    """One buggy variant of a module."""

    path: str
    operator: str
    line: int
    function: str
    source: str


Edit = Callable[[ast.AST], ast.AST | None]


def _flip_compare(index: int) -> Edit:
    def edit(node: ast.AST) -> ast.AST | None:
        if not isinstance(node, ast.Compare) or index >= len(node.ops):
            return None
        new = _FLIP_COMPARE.get(type(node.ops[index]))
        if new is None:
            return None
        node.ops[index] = new()
        return node

    return edit


def _swap_operator(node: ast.AST) -> ast.AST | None:
    if isinstance(node, ast.BinOp) and type(node.op) in _SWAP_OPERATOR:
        node.op = _SWAP_OPERATOR[type(node.op)]()
        return node
    return None


def _swap_operands(node: ast.AST) -> ast.AST | None:
    if isinstance(node, ast.BinOp) and isinstance(node.op, _NON_COMMUTATIVE):
        node.left, node.right = node.right, node.left
        return node
    if isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(node.ops[0], _ORDERING):
        node.left, node.comparators[0] = node.comparators[0], node.left
        return node
    return None


def _off_by_one(delta: int) -> Edit:
    def edit(node: ast.AST) -> ast.AST | None:
        if isinstance(node, ast.Constant) and type(node.value) is int and node.value + delta >= 0:
            return ast.Constant(value=node.value + delta)
        return None

    return edit


def _invert(node: ast.AST) -> ast.AST | None:
    if isinstance(node, ast.expr):
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            return node.operand
        return ast.UnaryOp(op=ast.Not(), operand=node)
    return None


EXPRESSION_OPERATORS: tuple[tuple[str, Edit], ...] = (
    ("flip-comparison", _flip_compare(0)),
    ("flip-comparison", _flip_compare(1)),
    ("swap-operator", _swap_operator),
    ("swap-operands", _swap_operands),
    ("off-by-one", _off_by_one(1)),
    ("off-by-one", _off_by_one(-1)),
)


def _condition_nodes(tree: ast.AST) -> set[int]:
    return {id(node.test) for node in ast.walk(tree) if isinstance(node, ast.If | ast.IfExp | ast.While)}


def _enclosing_functions(tree: ast.AST) -> dict[int, str]:
    owner: dict[int, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef):
            for child in ast.walk(node):
                owner[id(child)] = node.name
    return owner


def _replace_segment(source: str, node: ast.AST, text: str) -> str:
    lines = source.splitlines(keepends=True)
    row = node.lineno - 1  # type: ignore[attr-defined]
    raw = lines[row].encode()
    start, end = node.col_offset, node.end_col_offset  # type: ignore[attr-defined]
    lines[row] = (raw[:start] + text.encode() + raw[end:]).decode()
    return "".join(lines)


def _candidate_texts(new: ast.AST) -> Iterator[str]:
    text = ast.unparse(new)
    yield text
    yield f"({text})"


def _mutate_expression(source: str, index: int, edit: Edit) -> str | None:
    """Apply `edit` to the index-th node of a fresh tree; the new source, or None."""
    tree = ast.parse(source)
    nodes = list(ast.walk(tree))
    target = nodes[index]
    if getattr(target, "lineno", None) is None or target.lineno != target.end_lineno:  # type: ignore[attr-defined]
        return None
    original = copy.deepcopy(target)
    replacement = edit(target)
    if replacement is None:
        return None
    replacement = _substitute(tree, target, replacement)
    expected = ast.dump(tree)
    for text in _candidate_texts(replacement):
        mutated = _replace_segment(source, original, text)
        try:
            if ast.dump(ast.parse(mutated)) == expected:
                return mutated
        except SyntaxError:
            continue
    return None


def _substitute(tree: ast.AST, old: ast.AST, new: ast.AST) -> ast.AST:
    if new is old:
        return new
    for parent in ast.walk(tree):
        for field, value in ast.iter_fields(parent):
            if value is old:
                setattr(parent, field, new)
                return new
            if isinstance(value, list) and any(item is old for item in value):
                value[next(i for i, item in enumerate(value) if item is old)] = new
                return new
    return new


def _drop_statement(source: str, index: int) -> str | None:
    tree = ast.parse(source)
    nodes = list(ast.walk(tree))
    target = nodes[index]
    if not isinstance(target, _DROPPABLE) or target.lineno != target.end_lineno:
        return None
    if isinstance(target, ast.Expr) and isinstance(target.value, ast.Constant):
        return None  # a docstring
    for parent in ast.walk(tree):
        body = getattr(parent, "body", None)
        if isinstance(body, list) and target in body and len(body) > 1:
            body.remove(target)
            lines = source.splitlines(keepends=True)
            if lines[target.lineno - 1].strip() != ast.get_source_segment(source, target):
                return None
            del lines[target.lineno - 1]
            mutated = "".join(lines)
            return mutated if ast.dump(ast.parse(mutated)) == ast.dump(tree) else None
    return None


def _applicable(name: str, node: ast.AST) -> bool:
    """Cheap pre-check so only plausible sites pay for a re-parse."""
    if name == "flip-comparison":
        return isinstance(node, ast.Compare)
    if name == "swap-operator":
        return isinstance(node, ast.BinOp) and type(node.op) in _SWAP_OPERATOR
    if name == "swap-operands":
        return isinstance(node, ast.BinOp | ast.Compare)
    return isinstance(node, ast.Constant) and type(node.value) is int


def mutations(path: str, source: str) -> Iterator[Mutation]:
    """Every valid single-site mutation of `source`, in a deterministic order."""
    tree = ast.parse(source)
    nodes = list(ast.walk(tree))
    owner = _enclosing_functions(tree)
    conditions = _condition_nodes(tree)
    for index, node in enumerate(nodes):
        function = owner.get(id(node))
        if function is None:
            continue
        variants: list[tuple[str, str | None]] = [
            (name, _mutate_expression(source, index, edit))
            for name, edit in EXPRESSION_OPERATORS
            if _applicable(name, node)
        ]
        if id(node) in conditions:
            variants.append(("invert-condition", _mutate_expression(source, index, _invert)))
        if isinstance(node, _DROPPABLE):
            variants.append(("drop-statement", _drop_statement(source, index)))
        for name, mutated in variants:
            if mutated is not None and mutated != source:
                yield Mutation(
                    path=path,
                    operator=name,
                    line=node.lineno,  # type: ignore[attr-defined]
                    function=function,
                    source=mutated,
                )
