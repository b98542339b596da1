"""The numbers `python -m odc.train` and `python -m odc.fit` read from their command lines and data
files, parsed strictly and in one place (below both, so that odc.fit imports nothing of odc.train).
Python's int() and float() also take '+5', '1_0', ' 5 ' and other scripts' digits ('٣'), and
float() takes 'nan' and 'inf': none of them is a count or a setting someone meant, so each is
refused with a message saying what was expected. Invariant: every integer option of odc.train (and
odc.fit) and every count in its data files goes through `whole_number`, every float option through
`finite_number`.
"""

from __future__ import annotations

import argparse
import re

# An optional minus (so that a negative value is refused by its range check, which names the
# least value allowed) and ASCII digits; re's \d would take other scripts' digits.
_WHOLE = re.compile(r"-?[0-9]+")
_DECIMAL = re.compile(r"-?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][-+]?[0-9]+)?")


def whole_number(text: str) -> int:
    """`text` as an int: an optional '-' then the ASCII digits 0-9, nothing else (no '+', '_',
    spaces or other scripts' digits). ValueError otherwise."""
    if not _WHOLE.fullmatch(text):
        raise ValueError(f"expected a whole number (digits 0-9), got {text!r}")
    return int(text)


def finite_number(text: str) -> float:
    """`text` as a finite float in plain decimal or exponent notation with ASCII digits ('0.5',
    '-1', '3e-4'). ValueError for anything else: 'nan', 'inf', a value beyond a float's range
    ('1e999'), '+', '_', spaces or other scripts' digits."""
    if not _DECIMAL.fullmatch(text):
        raise ValueError(f"expected a finite number (e.g. 0.5 or 3e-4), got {text!r}")
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise ValueError(f"{text!r} is beyond the range of a float")
    return value


def option_type(parse):
    """An argparse `type` from `parse` (whole_number, finite_number or another that raises
    ValueError): its message after the option's name ('argument --steps: expected a whole
    number ...'), in place of argparse's "invalid int value"."""

    def convert(text):
        try:
            return parse(text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None

    convert.__name__ = parse.__name__
    return convert
