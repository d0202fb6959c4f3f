"""Where the prepared loaders' names were importable from before their room was named :mod:`runner.engine.loaders`.

Kept so scripts that import them from here still run; new code imports from :mod:`runner.engine.loaders` (or
Accelerate's names from :mod:`runner.engine.data_loader`). The datasets a config declares are :mod:`runner.data`'s.
"""

from runner.engine import loaders

__all__ = list(loaders.__all__)


def __getattr__(name: str):
    if name in __all__:
        return getattr(loaders, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
