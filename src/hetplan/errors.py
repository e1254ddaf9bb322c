"""The one exception type for bad user input: it names the field and the reason."""

from __future__ import annotations


class InputError(ValueError):
    """Bad input: ``field`` names what is wrong, ``reason`` says why."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


def shown(value: object) -> str:
    """Returns a value as a message shows it to a person: text in quotes, true/false, null,
    numbers as written, lists and mappings in YAML's flow style (never a Python repr)."""
    if isinstance(value, str):
        return f"'{value}'"
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, list | tuple | set | frozenset):
        return "[" + ", ".join(shown(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {shown(v)}" for k, v in value.items()) + "}"
    return str(value)


def invalid_yaml(name: object, exc: Exception) -> str:
    """Returns the reason a file ``name`` did not parse as YAML, on one line: where (the
    1-based line and column the parser stopped at) and what it met, e.g. "x.yaml is not
    valid YAML: line 2, column 1: expected ',' or ']', but got '<stream end>'" (PyYAML's
    own text spans several lines and quotes the file)."""
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None)
    parts = [f"{name} is not valid YAML"]
    if mark is not None:
        parts.append(f"line {mark.line + 1}, column {mark.column + 1}")
    if problem:
        parts.append(" ".join(str(problem).split()))
    return ": ".join(parts)
