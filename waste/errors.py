"""Error types shared by the library and the command line.

`WasteError` is a user-facing problem (bad input, damaged file, unknown format): the CLI
prints its message on one line and exits with code 2. `CheckFailed` means a numerical
check ran and did not pass: exit code 1.
"""

from __future__ import annotations


class WasteError(Exception):
    """Bad input or a damaged file; the message is one line naming the problem."""

    exit_code = 2


class ConfigError(WasteError):
    """A model config.json that is missing a key or holds an unexpected value."""


class CheckFailed(Exception):
    """A numerical check ran and exceeded its tolerance."""

    exit_code = 1


class NonFiniteError(WasteError):
    """NaN or infinity appeared in the hidden states or logits: the run stops (exit code 1)."""

    exit_code = 1
