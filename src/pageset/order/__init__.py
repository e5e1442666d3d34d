"""Sample order (order v1): which record ids, in what order, for which rank and step.

Pure functions of plain arrays and integers: this subpackage imports nothing else from pageset and never
imports torch. ``shuffle`` maps epoch positions to record ids, ``sharding`` maps (step, rank) to epoch
positions, ``state`` is the resume record, ``keys`` the counter-based randomness behind all of them.
"""

import functools

from .keys import key, key_py, sample_keys
from .sharding import epoch_end, epoch_length, local_batch, rank_positions, rank_span, resolve_rank, steps_per_epoch
from .shuffle import (
    DEFAULT_WINDOW_RECORDS,
    ORDERS,
    EpochOrder,
    epoch_permutation,
    page_permutation,
    quasi_random_range,
    random_permutation,
    sequential_range,
    window_layout,
    window_pages_for,
    window_pages_of,
)
from .state import (
    ORDER_ALGO,
    STATE_VERSION,
    OrderState,
    StateError,
    StateMismatchError,
    check_compatible,
    normalize_cursor,
    resume_cursor,
    resume_point,
)

__all__ = [
    "DEFAULT_WINDOW_RECORDS",
    "EpochOrder",
    "ORDERS",
    "ORDER_ALGO",
    "OrderState",
    "STATE_VERSION",
    "StateError",
    "StateMismatchError",
    "check_compatible",
    "epoch_end",
    "epoch_length",
    "epoch_permutation",
    "key",
    "key_py",
    "local_batch",
    "normalize_cursor",
    "page_permutation",
    "quasi_random_range",
    "random_permutation",
    "rank_positions",
    "rank_span",
    "resolve_rank",
    "resume_cursor",
    "resume_point",
    "sample_keys",
    "sequential_range",
    "steps_per_epoch",
    "window_layout",
    "window_pages_for",
    "window_pages_of",
]


@functools.cache
def enable_kernel_cache() -> None:
    """Cache this package's Numba kernels on disk (run time, never at import; a no-op where numba finds no
    writable cache directory, or under NUMBA_DISABLE_JIT). Saves ~1.4 s of compilation per new process."""
    import numba

    from . import keys, mixture, quotas, shuffle

    if numba.config.DISABLE_JIT:
        return
    for module in (keys, mixture, quotas, shuffle):
        for obj in vars(module).values():
            if isinstance(obj, numba.core.registry.CPUDispatcher):
                try:
                    obj.enable_caching()
                except RuntimeError:  # no writable cache location (read-only install)
                    return
