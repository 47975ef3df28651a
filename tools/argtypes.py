"""argparse `type=` checks shared by the tools: a bad value is refused naming its flag.

    p.add_argument("--gpus", type=positive_int, nargs="+")
    p.add_argument("--memory-gib", type=positive_float)
    p.add_argument("--group-sizes", type=int_list, default="2,4,8")

argparse reports `argument --gpus: ...` and exits 2 before the tool does any work. Floats must be
finite (argparse's own `float` accepts nan and inf, which then compare false everywhere).
"""
from __future__ import annotations

import argparse
import math
from typing import Callable

__all__ = ["positive_int", "non_negative_int", "int_at_most", "positive_float",
           "non_negative_float", "fraction", "int_list", "point_list"]


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None


def _float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r}: give a finite number")
    return value


def positive_int(text: str) -> int:
    value = _int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value}: give an integer >= 1")
    return value


def non_negative_int(text: str) -> int:
    value = _int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value}: give an integer >= 0")
    return value


def int_at_most(limit: int, why: str) -> Callable[[str], int]:
    """An int in [1, limit]; `why` says what the limit protects."""
    def check(text: str) -> int:
        value = positive_int(text)
        if value > limit:
            raise argparse.ArgumentTypeError(f"{value} is beyond the limit of {limit:,} ({why})")
        return value
    check.__name__ = "int"
    return check


def positive_float(text: str) -> float:
    value = _float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{value:g}: give a number > 0")
    return value


def non_negative_float(text: str) -> float:
    value = _float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value:g}: give a number >= 0")
    return value


def fraction(text: str) -> float:
    value = _float(text)
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"{value:g}: give a fraction in (0, 1)")
    return value


def int_list(text: str) -> tuple:
    """`2,4,8` -> (2, 4, 8), each >= 1."""
    try:
        return tuple(positive_int(x) for x in text.split(","))
    except argparse.ArgumentTypeError as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: {exc}; give a comma list of integers >= 1, "
                                         "e.g. 2,4,8") from None


def point_list(text: str) -> tuple:
    """`256:1280:16,1280:256:2` -> ((256, 1280, 16), (1280, 256, 2)), each part >= 1."""
    points = []
    for part in text.split(","):
        fields = part.split(":")
        try:
            if len(fields) != 3:
                raise argparse.ArgumentTypeError(f"{len(fields)} field(s)")
            points.append(tuple(positive_int(x) for x in fields))
        except argparse.ArgumentTypeError as exc:
            raise argparse.ArgumentTypeError(
                f"{part!r} ({exc}); give PREFIX:SUFFIX:GROUP_SIZE points, integers >= 1, "
                "separated by commas, e.g. 256:1280:16,1280:256:2") from None
    return tuple(points)
