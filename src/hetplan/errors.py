"""The one exception type for bad user input: it names the field and the reason."""

from __future__ import annotations


class InputError(ValueError):
    """Bad input: ``field`` names what is wrong, ``reason`` says why."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason
