"""The on-disk cache of pageset's Numba kernels: enabled per module, at run time (never at import).

Every ``@numba.njit`` function of a module is cached, the helpers too, not only the kernels called from
Python: a kernel compiled in another process (``pageset warmup`` compiles in parallel processes) or a second
specialization of a caller (a uint8 batch after a float32 one) then loads its callees from the cache instead of
compiling them again (measured: the resize + JPEG helpers are ~2/3 of an image slice kernel's compile time).

Where numba puts the cache: ``NUMBA_CACHE_DIR`` when that variable is set, else ``__pycache__`` next to the
module when it is writable, else a user-wide directory (``~/.cache/numba`` style); see :func:`cache_dir`.
"""

from __future__ import annotations

import types

import numba
from numba.core.registry import CPUDispatcher


def dispatchers(module: types.ModuleType) -> list[CPUDispatcher]:
    """The ``@njit`` functions defined in ``module`` (re-exported ones belong to their own module)."""
    return [obj for obj in vars(module).values()
            if isinstance(obj, CPUDispatcher) and obj.py_func.__module__ == module.__name__]


def enable(*modules: types.ModuleType) -> bool:
    """Cache every ``@njit`` function of ``modules`` on disk; False (nothing enabled) where numba finds no
    writable cache directory (a read-only install: the kernels then compile in each process) or under
    ``NUMBA_DISABLE_JIT``. Idempotent."""
    if numba.config.DISABLE_JIT:
        return False
    for module in modules:
        for disp in dispatchers(module):
            try:
                disp.enable_caching()
            except RuntimeError:  # "cannot cache function ...: no locator available"
                return False
    return True


def cache_dir(module: types.ModuleType) -> str | None:
    """The directory numba caches ``module``'s kernels in (None when caching is off or impossible)."""
    for disp in dispatchers(module):
        path = getattr(getattr(disp, "_cache", None), "cache_path", None)
        if path:
            return str(path)
    return None
