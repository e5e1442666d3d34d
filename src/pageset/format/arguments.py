"""Checks for the arguments of public constructors and functions: each returns the normalised value or raises
``TypeError`` (wrong kind of value) / ``ValueError`` (right kind, out of range) naming the argument, what it
accepts and what it got.

    size = pair_of_ints("RandomResizedCrop.size", size, minimum=1)   # 224 -> (224, 224); "22" -> TypeError
    seed = integer("seed", seed, minimum=0, maximum=2**64 - 1)        # None, "0", 1.5, True -> TypeError

Strings are never taken as sequences of numbers, bools never as numbers, floats never as ints: a value that
could be a typo is refused rather than reinterpreted.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence


def _sequence(value):
    """A 1-D numpy array as a list (arrays are not ``collections.abc.Sequence``); anything else unchanged."""
    if type(value).__name__ == "ndarray" and getattr(value, "ndim", 0) == 1:
        return value.tolist()
    return value


def _got(value) -> str:
    return f"got {value!r} ({type(value).__name__})"


def is_int(value) -> bool:
    """True for Python and numpy integers, False for bools, floats and strings."""
    return isinstance(value, numbers.Integral) and not _is_bool(value)


def _is_bool(value) -> bool:
    return isinstance(value, bool) or type(value).__name__ in ("bool_", "bool") and hasattr(value, "dtype")


def _is_real(value) -> bool:
    return isinstance(value, numbers.Real) and not _is_bool(value)


def integer(name: str, value, *, minimum: int | None = None, maximum: int | None = None,
            optional: bool = False) -> int | None:
    """``value`` as an ``int`` in ``[minimum, maximum]``; ``None`` passes through when ``optional``."""
    if value is None and optional:
        return None
    if not is_int(value):
        raise TypeError(f"{name} must be an int{_range(minimum, maximum)}{' or None' if optional else ''}, "
                        f"{_got(value)}")
    value = int(value)
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        raise ValueError(f"{name} must be an int{_range(minimum, maximum)}, got {value}")
    return value


def _range(minimum, maximum) -> str:
    if minimum is not None and maximum is not None:
        return f" in [{minimum}, {maximum}]"
    if minimum is not None:
        return f" >= {minimum}"
    if maximum is not None:
        return f" <= {maximum}"
    return ""


def real(name: str, value, *, low: float | None = None, high: float | None = None, low_open: bool = False,
         high_open: bool = False) -> float:
    """``value`` (an int or float, not a bool or string) as a finite ``float`` in the interval given by
    ``low``/``high`` (closed unless ``low_open``/``high_open``)."""
    interval = _interval(low, high, low_open, high_open)
    if not _is_real(value):
        raise TypeError(f"{name} must be a number{interval}, {_got(value)}")
    value = float(value)
    bad = value != value or value in (float("inf"), float("-inf"))
    if low is not None:
        bad |= value <= low if low_open else value < low
    if high is not None:
        bad |= value >= high if high_open else value > high
    if bad:
        raise ValueError(f"{name} must be a finite number{interval}, got {value!r}")
    return value


def _interval(low, high, low_open, high_open) -> str:
    if low is None and high is None:
        return ""
    if high is None:
        return f" {'>' if low_open else '>='} {low}"
    if low is None:
        return f" {'<' if high_open else '<='} {high}"
    return f" in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"


def boolean(name: str, value) -> bool:
    """``value`` as a ``bool``: only ``True``/``False`` (or numpy bools), never ``"no"``, ``0`` or ``None``."""
    if not _is_bool(value):
        raise TypeError(f"{name} must be True or False, {_got(value)}")
    return bool(value)


def choice(name: str, value, options: Sequence):
    """``value`` if it is one of ``options`` (compared by equality, strings only match strings)."""
    if isinstance(value, str) and value in options:
        return value
    if not isinstance(value, str) and not any(isinstance(o, str) for o in options) and value in options:
        return value
    raise ValueError(f"{name} must be one of {tuple(options)}, {_got(value)}")


def text(name: str, value, *, optional: bool = False, empty: bool = False) -> str | None:
    """``value`` as a ``str`` (non-empty unless ``empty``); ``None`` passes through when ``optional``."""
    if value is None and optional:
        return None
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a string{' or None' if optional else ''}, {_got(value)}")
    if not value and not empty:
        raise ValueError(f"{name} must be a non-empty string, got ''")
    return value


def numbers_tuple(name: str, value, length: int, *, low: float | None = None, high: float | None = None,
                  low_open: bool = False) -> tuple[float, ...]:
    """``value`` as a tuple of ``length`` floats, each checked like :func:`real`."""
    value = _sequence(value)
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or len(value) != length:
        raise TypeError(f"{name} must be a sequence of {length} numbers, {_got(value)}")
    return tuple(real(f"{name}[{k}]", v, low=low, high=high, low_open=low_open) for k, v in enumerate(value))


def ordered_pair(name: str, value, *, low: float = 0.0) -> tuple[float, float]:
    """``(lo, hi)``: two numbers with ``low < lo <= hi`` (a scale or aspect-ratio range)."""
    lo, hi = numbers_tuple(name, value, 2, low=low, low_open=True)
    if lo > hi:
        raise ValueError(f"{name} must be (lo, hi) with lo <= hi, got {value!r}")
    return lo, hi


def pair_of_ints(name: str, value, *, minimum: int = 1, maximum: int | None = None) -> tuple[int, int]:
    """``(height, width)`` from an int (a square) or a sequence of two ints, each in ``[minimum, maximum]``:
    torchvision's ``size`` convention. A string, a float or a sequence of another length is a TypeError."""
    value = _sequence(value)
    if is_int(value):
        h = w = integer(name, value, minimum=minimum, maximum=maximum)
        return h, w
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or len(value) != 2:
        raise TypeError(f"{name} must be an int or a (height, width) pair of ints, {_got(value)}")
    return (integer(f"{name}[0] (height)", value[0], minimum=minimum, maximum=maximum),
            integer(f"{name}[1] (width)", value[1], minimum=minimum, maximum=maximum))


def ints_tuple(name: str, value, *, minimum: int = 0) -> tuple[int, ...]:
    """``value`` (a sequence of ints, or one int) as a tuple of ints ``>= minimum`` (an array shape)."""
    value = _sequence(value)
    if is_int(value):
        return (integer(name, value, minimum=minimum),)
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise TypeError(f"{name} must be a tuple of ints, {_got(value)}")
    return tuple(integer(f"{name}[{k}]", v, minimum=minimum) for k, v in enumerate(value))


def mapping(name: str, value, *, optional: bool = False, example: str = "") -> dict | None:
    """``value`` as a ``dict`` (any Mapping); ``None`` passes through when ``optional``."""
    if value is None and optional:
        return None
    if not isinstance(value, Mapping):
        hint = f", e.g. {example}" if example else ""
        raise TypeError(f"{name} must be a dict{' or None' if optional else ''}{hint}; {_got(value)}")
    return dict(value)


def dtype_name(name: str, value, options: Sequence[str]) -> str:
    """A dtype given by name (``"int32"``) or as a numpy dtype / scalar type (``np.int32``), as its name, if
    the name is one of ``options``."""
    import numpy as np

    if not isinstance(value, str):
        try:
            value = np.dtype(value).name if isinstance(value, (np.dtype, type)) else value
        except TypeError:
            pass
    return choice(name, value, options)


def json_metadata(name: str, value: dict | None) -> None:
    """TypeError naming ``name`` and the first key whose value is not JSON-serialisable (the writers store user
    metadata as JSON); ValueError for NaN / infinity, which JSON cannot hold."""
    import json

    if value is None:
        return
    for key, item in value.items():
        try:
            json.dumps({key: item}, sort_keys=True, allow_nan=False)
        except TypeError as exc:
            raise TypeError(f"{name}[{key!r}] is not JSON-serialisable ({exc}); {name} values must be str, int, "
                            "float, bool, None, or lists / dicts of them") from None
        except ValueError as exc:
            raise ValueError(f"{name}[{key!r}]: {exc}; JSON holds no NaN or infinity") from None
