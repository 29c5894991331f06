"""A table's callables written into the generated rows that call them.

A row calls its guards, effects, builders and deadline functions, and each
call costs about as much as the work most of them do (an attribute test, an
assignment).  Where a callable is a plain function whose body is one
``return <expression>`` (a guard, builder or deadline) or statements
without ``return`` (an effect), its body is written into the row instead:
its parameters renamed to the row's arguments, its locals and the globals it
reads renamed to names private to that one use, and those globals bound in
the row's scope when the machine is compiled.  Anything else stays a call:
a closure, a builtin or partial, a function with defaults or ``*args``, one
whose source cannot be found, a nested function, lambda, ``global``,
``yield``, ``await`` or walrus, a parameter assigned to, a global that is
not a module, class, function or immutable constant (it could be rebound),
or a name that does not resolve.

The callable stays the single source: the row's text is derived from it
when the machine is compiled (the reference interpreter and the diagrams
still use the callable itself, and tests compare the two).  Compiling reads
the machines' own source files once, as ``inspect.getsource`` does: the only
reading this package does, at definition time, never on a transition; where
the source is absent the rows call, and behave the same.
"""
from __future__ import annotations

import ast
import builtins
import inspect
import linecache
import types
from typing import Any

from .base import fields

# Globals an inlined body may read, bound once at compile time: values that
# a module does not rebind (a rebound global would go stale in the row).
_BOUND_TYPES = (types.ModuleType, type, types.FunctionType, types.BuiltinFunctionType, int, float, str, bytes,
                bool, type(None), frozenset, tuple)
_REFUSED_NODES = (ast.Lambda, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Global, ast.Nonlocal,
                  ast.Yield, ast.YieldFrom, ast.Await, ast.NamedExpr, ast.Return)
_PLAIN = ~(inspect.CO_VARARGS | inspect.CO_VARKEYWORDS | inspect.CO_GENERATOR | inspect.CO_COROUTINE
           | inspect.CO_ASYNC_GENERATOR | inspect.CO_ITERABLE_COROUTINE)


class _NotInlinable(Exception):
    pass


def inline_expression(fn: Any, args: tuple[str, ...], scope: dict[str, Any], tag: str) -> str | None:
    """The expression (parenthesized) that ``fn(*args)`` returns, written
    over the names ``args``, or None where ``fn`` stays a call."""
    return _remembered(_expression, fn, args, scope, tag, 0)


def inline_statements(fn: Any, args: tuple[str, ...], scope: dict[str, Any], tag: str,
                      depth: int = 0) -> list[str] | None:
    """The statements (not indented) that ``fn(*args)`` runs, for a
    function returning nothing, or None where ``fn`` stays a call."""
    return _remembered(_statements, fn, args, scope, tag, depth)


# (writer, callable, arguments, tag, depth) -> (its text, the names it bound in
# scope): the plane writes a row again in each pass of wire_inline, and
# every machine set compiles the same callables.
_REMEMBERED: dict[tuple, tuple[Any, dict[str, Any]]] = {}
_REMEMBER_AT_MOST = 20_000


def _remembered(write: Any, fn: Any, args: tuple[str, ...], scope: dict[str, Any], tag: str, depth: int) -> Any:
    key = (write, fn, args, tag, depth)
    known = _REMEMBERED.get(key)
    if known is None:
        bound: dict[str, Any] = {}
        known = (write(fn, args, bound, tag, depth), bound)
        if len(_REMEMBERED) >= _REMEMBER_AT_MOST:
            _REMEMBERED.clear()
        _REMEMBERED[key] = known
    scope.update(known[1])
    text = known[0]
    return list(text) if isinstance(text, list) else text


def _expression(fn: Any, args: tuple[str, ...], scope: dict[str, Any], tag: str, depth: int) -> str | None:
    try:
        node, params = _function(fn, len(args))
        expr = _single_expression(node)
        _refuse_nodes([expr])
        renamed = _Renamer(fn, dict(zip(params, args)), scope, tag, [expr]).visit(_copy(expr))
        return f"({ast.unparse(renamed)})"
    except _NotInlinable:
        return None


def _statements(fn: Any, args: tuple[str, ...], scope: dict[str, Any], tag: str, depth: int) -> list[str] | None:
    try:
        node, params = _function(fn, len(args))
        if isinstance(node, ast.Lambda):
            return None
        body = _without_docstring(node.body)
        if not body:
            return ["pass"]
        _refuse_nodes(body)
        renamer = _Renamer(fn, dict(zip(params, args)), scope, tag, body)
        lines: list[str] = []
        for n, stmt in enumerate(body):
            nested = _passing_on(fn, stmt, params)
            inner = None if nested is None or depth >= _MAX_DEPTH else \
                inline_statements(nested, args, scope, f"{tag}_{n}", depth + 1)
            lines += inner if inner is not None else ast.unparse(renamer.visit(_copy(stmt))).splitlines()
        return lines
    except _NotInlinable:
        return None


# How deep an effect that hands its own arguments on to another is followed.
_MAX_DEPTH = 3


def _passing_on(fn: types.FunctionType, stmt: ast.stmt, params: tuple[str, ...]) -> Any:
    """The function that ``stmt`` calls with exactly ``fn``'s own parameters,
    in order (an effect built from another, ``_bind(lease, ev, cfg, now)``),
    or None."""
    if not (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call)):
        return None
    c = stmt.value
    if c.keywords or not isinstance(c.func, ast.Name) or c.func.id in params \
            or [a.id if isinstance(a, ast.Name) else None for a in c.args] != list(params):
        return None
    if c.func.id in fn.__code__.co_varnames:
        return None  # a local, not the module's function
    return fn.__globals__.get(c.func.id)


def _function(fn: Any, arity: int) -> tuple[ast.FunctionDef | ast.Lambda, tuple[str, ...]]:
    """The syntax tree of a plain function taking exactly ``arity`` positional
    parameters, found in its module's source by its first line and name."""
    if type(fn) is not types.FunctionType or fn.__closure__ or fn.__defaults__ or fn.__kwdefaults__:
        raise _NotInlinable
    code = fn.__code__
    if code.co_flags & ~_PLAIN or code.co_argcount != arity or code.co_kwonlyargcount or code.co_posonlyargcount:
        raise _NotInlinable
    params = code.co_varnames[:arity]
    candidates = [n for n in _module_nodes(code.co_filename) if _defines(n, fn, code.co_firstlineno, params)]
    if len(candidates) != 1:  # none found, or two lambdas on one line: which is which is unknowable here
        raise _NotInlinable
    return candidates[0], params


def _defines(node: ast.AST, fn: types.FunctionType, first_line: int, params: tuple[str, ...]) -> bool:
    if isinstance(node, ast.Lambda):
        if fn.__name__ != "<lambda>" or node.lineno != first_line:
            return False
    elif isinstance(node, ast.FunctionDef):
        lines = {node.lineno, *(d.lineno for d in node.decorator_list)}
        if node.name != fn.__name__ or first_line not in lines:
            return False
    else:
        return False
    a = node.args
    return not (a.posonlyargs or a.vararg or a.kwonlyargs or a.kwarg or a.defaults) \
        and tuple(p.arg for p in a.args) == params


_Node = ast.FunctionDef | ast.Lambda
_TREES: dict[str, tuple[str, list[_Node]]] = {}


def _module_nodes(filename: str) -> list[_Node]:
    """Every function and lambda node of a source file (cached per file and text)."""
    text = "".join(linecache.getlines(filename))
    cached = _TREES.get(filename)
    if cached is not None and cached[0] == text:
        return cached[1]
    if not text:
        raise _NotInlinable
    try:
        tree = ast.parse(text, filename)
    except SyntaxError as exc:
        raise _NotInlinable from exc
    nodes: list[_Node] = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.Lambda))]
    _TREES[filename] = (text, nodes)
    return nodes


def _single_expression(node: _Node) -> ast.expr:
    """What a lambda or a function of one ``return <expression>`` returns."""
    if isinstance(node, ast.Lambda):
        return node.body
    body = _without_docstring(node.body)
    if len(body) != 1 or not isinstance(body[0], ast.Return) or body[0].value is None:
        raise _NotInlinable
    return body[0].value


# Builtins whose call changes nothing: a written-in call whose arguments are
# read where it uses them (not before it starts) may call only these, so that
# nothing it does can change what an argument reads.
_PURE_BUILTINS = frozenset({"len", "min", "max", "abs", "isinstance", "bool", "int", "float", "str", "tuple",
                            "frozenset", "any", "all", "sum", "round", "sorted"})


def _only_pure_calls(fn: types.FunctionType, expr: ast.expr) -> None:
    for n in ast.walk(expr):
        if isinstance(n, ast.Call):
            name = n.func.id if isinstance(n.func, ast.Name) else None
            if name not in _PURE_BUILTINS or name in fn.__globals__ or name in fn.__code__.co_varnames:
                raise _NotInlinable


def _rereadable(arg: ast.expr) -> bool:
    """A name, a constant, or an attribute of one: reading it again (or not) is the same."""
    while isinstance(arg, ast.Attribute):
        arg = arg.value
    return isinstance(arg, (ast.Name, ast.Constant))


def _without_docstring(body: list[ast.stmt]) -> list[ast.stmt]:
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        return body[1:]
    return body


def _refuse_nodes(nodes: list) -> None:
    for top in nodes:
        for n in ast.walk(top):
            if isinstance(n, _REFUSED_NODES):
                raise _NotInlinable


def _copy(node: ast.AST) -> Any:
    # The cached tree is shared: rename a copy.
    return ast.parse(ast.unparse(node), mode="exec").body[0] if isinstance(node, ast.stmt) \
        else ast.parse(ast.unparse(node), mode="eval").body


class _Renamer(ast.NodeTransformer):
    """Parameters -> the row's names; every other name -> ``_<tag>_<name>``:
    locals as they are, globals and builtins bound in ``scope``."""

    def __init__(self, fn: types.FunctionType, params: dict[str, str | ast.expr], scope: dict[str, Any], tag: str,
                 body: list, depth: int = 0):
        self.fn, self.params, self.scope, self.tag, self.depth = fn, params, scope, tag, depth
        self.nested = 0  # calls written in so far (each gets its own tag)
        # Every name bound in the body (comprehension targets too: their code
        # is not the function's, so co_varnames misses them).
        stored = {n.id for top in body for n in ast.walk(top)
                  if isinstance(n, ast.Name) and not isinstance(n.ctx, ast.Load)}
        self.locals = (set(fn.__code__.co_varnames) | stored) - set(params)

    def visit_Name(self, node: ast.Name) -> ast.expr:
        if node.id in self.params:
            if not isinstance(node.ctx, ast.Load):
                raise _NotInlinable  # a parameter rebound: the row's own variable would change
            value = self.params[node.id]
            if isinstance(value, str):
                return ast.copy_location(ast.Name(value, node.ctx), node)
            return _copy(value)
        private = f"_{self.tag}_{node.id}"
        if node.id not in self.locals:
            self.scope[private] = self._global(node.id)
        return ast.copy_location(ast.Name(private, node.ctx), node)

    def visit_Call(self, node: ast.Call) -> ast.expr:
        """A call of a module function that returns one expression, with
        arguments that are names, constants or attributes of names (reading
        them again or not at all changes nothing), is written in as well:
        ``admits(lease, ev.sender)`` in a guard."""
        node = self.generic_visit(node)  # type: ignore[assignment]  # the arguments, renamed
        callee = self._callee(node)
        if callee is None or self.depth >= _MAX_DEPTH:
            return node
        try:
            inner, params = _function(callee, len(node.args))
            expr = _single_expression(inner)
            _refuse_nodes([expr])
            _only_pure_calls(callee, expr)
            renamer = _Renamer(callee, dict(zip(params, node.args)), self.scope, f"{self.tag}_{self.nested}", [expr],
                               self.depth + 1)
            self.nested += 1
            return ast.copy_location(renamer.visit(_copy(expr)), node)
        except _NotInlinable:
            return node

    def _callee(self, node: ast.Call) -> Any:
        if node.keywords or not isinstance(node.func, ast.Name) or not all(map(_rereadable, node.args)):
            return None
        name = node.func.id  # renamed: a bound global is in scope under it
        return self.scope.get(name) if name.startswith(f"_{self.tag}_") and name[len(self.tag) + 2:] \
            not in self.locals else None

    def _global(self, name: str) -> Any:
        g = self.fn.__globals__
        if name in g:
            value = g[name]
        elif hasattr(builtins, name):
            value = getattr(builtins, name)
        else:
            raise _NotInlinable  # would raise NameError when called: leave that to the call
        if not isinstance(value, _BOUND_TYPES) or (isinstance(value, tuple) and not _immutable(value)):
            raise _NotInlinable
        return value


def _immutable(value: tuple) -> bool:
    return all(isinstance(v, _BOUND_TYPES) and (not isinstance(v, tuple) or _immutable(v)) for v in value)


# ----------------------------------------------------------- event properties
_ALIASES: dict[type, dict[str, str]] = {}


def field_aliases(cls: type) -> dict[str, str]:
    """Properties of the event class ``cls`` whose getter is one ``return
    self.<field>`` of its own fields (``ConsumerDone.sender`` ->
    ``consumer``): name -> field.  A row over an event of ``cls`` reads the
    field itself (a property call costs about four plain reads)."""
    known = _ALIASES.get(cls)
    if known is None:
        names = {f.name for f in fields(cls)}
        known = {}
        for klass in reversed(cls.__mro__):
            for name, value in vars(klass).items():
                known.pop(name, None)  # redefined below: only the last definition counts
                if not isinstance(value, property) or value.fset is not None or value.fdel is not None:
                    continue
                try:
                    node, (self_name,) = _function(value.fget, 1)
                    expr = _single_expression(node)
                except _NotInlinable:
                    continue
                if isinstance(expr, ast.Attribute) and isinstance(expr.value, ast.Name) \
                        and expr.value.id == self_name and expr.attr in names:
                    known[name] = expr.attr
        _ALIASES[cls] = known
    return known


def read_fields_for_aliases(body: list[str], event: type, name: str = "ev") -> list[str]:
    """``body`` (statements indented one level, over the event variable
    ``name``) with every read of an aliased property of ``event``
    (``field_aliases``) replaced by a read of its field."""
    aliases = field_aliases(event)
    if not any(f"{name}.{a}" in line for a in aliases for line in body):
        return body

    class Reads(ast.NodeTransformer):
        def visit_Attribute(self, node: ast.Attribute) -> ast.Attribute:
            self.generic_visit(node)
            if isinstance(node.value, ast.Name) and node.value.id == name and isinstance(node.ctx, ast.Load) \
                    and node.attr in aliases:
                node.attr = aliases[node.attr]
            return node

    function = ast.parse("def _():\n" + "\n".join(body)).body[0]
    assert isinstance(function, ast.FunctionDef)
    Reads().visit(function)
    return ["    " + line for stmt in function.body for line in ast.unparse(stmt).splitlines()]
