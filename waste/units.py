"""Parsing and printing of sizes and token counts for the command line and reports."""

from __future__ import annotations

import re
from fractions import Fraction

from waste.errors import WasteError

# The largest bandwidth waste plans with, in GB/s (--disk-gbps, --mem-gbps, the measurements'
# cache): far above any machine's, and small enough that a token's seconds stay above zero.
MAX_GBPS = 1e6

_BINARY = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
# A number, then nothing, a unit letter optionally followed by B or iB (4K, 4KB, 4KiB), or a lone B.
# ASCII digits only (Python's \d also takes "²" and full-width digits); the value is computed exactly
# (a float would show 10**26 typed as 100000000000000004764729344).
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(?:([KMGT])(I?B)?|(B))?\s*$", re.IGNORECASE | re.ASCII)


def parse_count(text: str | int, what: str = "count") -> int:
    """A token count such as 4096, 4K, 128K or 1M (binary multiples: 4K = 4096)."""
    if isinstance(text, int):
        value = text
    else:
        m = _SIZE.match(str(text))
        if not m or m.group(3) or m.group(4):
            raise WasteError(f"{what} {text!r}: expected a whole number such as 4096, 4K, 128K or 1M")
        exact = Fraction(m.group(1)) * _BINARY[(m.group(2) or "").upper()]
        if exact.denominator != 1:
            raise WasteError(f"{what} {text!r}: not a whole number of tokens")
        value = int(exact)
    if value < 0:
        raise WasteError(f"{what} {text!r}: must not be negative")
    return value


def parse_size(text: str | int, what: str = "size") -> int:
    """A byte size such as 512M, 24G, 24GiB or 1073741824 (binary multiples)."""
    if isinstance(text, int):
        return text
    m = _SIZE.match(str(text))
    if not m:
        raise WasteError(f"{what} {text!r}: expected a byte size such as 512M, 24G or 24GiB")
    number, unit = Fraction(m.group(1)), (m.group(2) or "").upper()
    if not unit and number.denominator != 1:  # "1.5" meant 1.5 of some unit, not one byte
        raise WasteError(f"{what} {text!r}: a fraction of a byte; give a unit, such as {text}G")
    return int(number * _BINARY[unit])


def human_bytes(n: float) -> str:
    """Bytes in binary units with three significant figures: 414 MiB, 1.5 GiB."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if unit == "B":
            if abs(value) < 1024:
                return f"{int(value)} B"
        else:
            # Three figures, but 1000-1023 in four ("{:.3g}" wrote 1010 MiB as "1.01e+03 MiB"); a
            # value that rounds to 1024 is the next unit's 1 (1023.7 KiB is "1 MiB", not "1024 KiB").
            text = f"{value:.0f}" if abs(value) >= 999.5 else f"{value:.3g}"
            if abs(float(text)) < 1024 or unit == "PiB":
                return f"{text} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def human_count(n: int) -> str:
    """A token count in the K/M form used for contexts: 4K, 128K, 1M, 1536."""
    for unit, mult in (("M", 1 << 20), ("K", 1 << 10)):
        if n >= mult and n % mult == 0:
            return f"{n // mult}{unit}"
    return str(n)
