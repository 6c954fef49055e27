"""Internal: the DuckDB the verdict engine calls.

DuckDB 2's Python package is a layer of Python over its extension module ``_duckdb``. Importing the package
costs about 0.08 s of CPU (its relational API, the version read from the installed distributions), a tenth of
explaining one conversation from the command line, which calls only what the extension itself defines
(connect, execute, fetchall, its exceptions). So connections come from the extension where there is one;
whatever needs the package's Python layer (Arrow results, registering Arrow tables) imports it first
(:func:`with_python_layer`). Where the extension module has no ``connect``, the package is used.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import TYPE_CHECKING, Any


def _core() -> ModuleType:
    try:
        core = importlib.import_module("_duckdb")
    except ImportError:
        core = None
    if core is None or not hasattr(core, "connect"):
        return importlib.import_module("duckdb")
    return core


if TYPE_CHECKING:
    import duckdb

    Connection = duckdb.DuckDBPyConnection
else:
    Connection = Any

CORE: ModuleType = _core()
InvalidInputException: type[Exception] = CORE.InvalidInputException
ConversionException: type[Exception] = CORE.ConversionException


def connect(**kwargs: Any) -> Connection:
    """A connection (the extension's ``connect``)."""
    con: Connection = CORE.connect(**kwargs)
    return con


def with_python_layer() -> None:
    """Import DuckDB's Python package, which adds the methods written in Python (``sql``, Arrow results) to every
    connection, those opened before included."""
    importlib.import_module("duckdb")
