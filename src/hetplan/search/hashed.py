"""A memo key whose hash is taken once."""

from __future__ import annotations


class Hashed:
    """A value with its hash taken once (a memo key whose hash would walk it every time);
    equal to another holding an equal value."""

    __slots__ = ("hash", "source", "value")

    def __init__(self, value: object, source: object = None) -> None:
        self.value = value
        self.hash = hash(value)
        self.source = source  # what the value was made from (memos by its id keep it)

    def __hash__(self) -> int:
        return self.hash

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Hashed):
            return NotImplemented
        return self.value is other.value or (self.hash == other.hash and self.value == other.value)
