"""The rule type of config_support.py's table, and its builders (no Megatron import)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional

__all__ = ["Rule", "group", "refuse"]


@dataclass(frozen=True)
class Rule:
    kind: str
    """"supported", "irrelevant" or "refused"."""
    why: str
    """Supported: the test that holds it exact; otherwise the reason."""
    allowed: Optional[Callable[[Any], bool]] = None
    """Values accepted (None: all); others are refused with `fix`."""
    fix: str = ""
    """What to do when refused."""
    example: Any = None
    """A refused value (tests use it)."""


def _off(value) -> bool:
    return not value


def group(kind: str, why: str, names: str, **kw) -> Dict[str, Rule]:
    """The same rule for each of the space-separated field `names`."""
    return {name: Rule(kind, why, **kw) for name in names.split()}


def refuse(name: str, why: str, fix: str, example: Any, allowed=_off) -> Dict[str, Rule]:
    """Field `name` is refused unless `allowed(value)` (default: falsy), with `fix`."""
    return {name: Rule("refused", why, allowed=allowed, fix=fix, example=example)}
