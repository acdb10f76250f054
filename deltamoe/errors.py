"""Typed errors shared by the CLI and the server.

Each error names the field, tensor or file at fault and what was expected, so the CLI can
print it as one line (plus a hint) and exit with code 2, and the server can map it to a
4xx body.
"""

from __future__ import annotations


class DeltaMoEError(Exception):
    """Base class: a user-facing error with a field and an optional hint."""

    def __init__(self, message: str, *, field: str | None = None, hint: str | None = None):
        self.field = field
        self.hint = hint
        super().__init__(message)

    def one_line(self) -> str:
        """The message as the CLI prints it: `field: message (hint: ...)`."""
        text = str(self)
        if self.field and not text.startswith(self.field):
            text = f"{self.field}: {text}"
        if self.hint:
            text = f"{text} (hint: {self.hint})"
        return text


class ConfigError(DeltaMoEError):
    """An invalid model, training, serving or planning configuration."""


class CheckpointError(DeltaMoEError):
    """A checkpoint that is missing, malformed, or does not match the model."""


class RequestError(DeltaMoEError):
    """A bad serving request (mapped to HTTP 4xx by the server)."""


class HardwareError(DeltaMoEError):
    """An unknown accelerator, or a plan that needs a number no vendor disclosed."""


class TraceError(DeltaMoEError):
    """A trace file that cannot be read."""


class TrainingError(DeltaMoEError):
    """A training run that cannot go on (a non-finite loss or gradient norm)."""
