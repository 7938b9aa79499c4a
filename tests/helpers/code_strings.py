"""The string constants a module's code holds, docstrings left out: what a "spelled only here" test reads."""

from __future__ import annotations

import ast


def code_strings(source: str) -> list[ast.Constant]:
    """Every ``str`` constant of ``source``'s code (f-string parts included); docstrings are prose, not code.

    Example:
        >>> [node.value for node in code_strings("def f():\\n    'doc'\\n    return 'a'  # 'b'\\n")]
        ['a']
    """
    tree = ast.parse(source)
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    return [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
    ]
