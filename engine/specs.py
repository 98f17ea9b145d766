"""Where a user's code is: "package.module:NAME" or "path/to/file.py:NAME", for a reward
function, an environment class or an advantage estimator, loaded in the driver and in every
worker that uses it.

Invariants:
- a file is loaded under a name of its own that is not registered in sys.modules, so cloudpickle
  ships what it defines to Ray workers by value: the file need not be importable there;
- a spec that cannot be loaded is one ValueError (or TypeError) naming the spec, which the config
  check turns into a config error before the run starts.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import Any


def load_function(spec: str, what: str = "reward function") -> Callable:
    """Resolve ``"package.module:function"`` or ``"path/to/file.py:function"`` to a callable (a
    class too: an environment is named the same way)."""
    fn = load_object(spec, what)
    if not callable(fn):
        raise TypeError(f"{spec.rpartition(':')[0]}:{spec.rpartition(':')[2]} is a {type(fn).__name__}, "
                        "not a function or class")
    return fn


def load_object(spec: str, what: str) -> Any:
    """What ``"package.module:name"`` or ``"path/to/file.py:name"`` names (a user's reward function,
    environment class or advantage estimator)."""
    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name:
        raise ValueError(f"{what} spec {spec!r} must be 'package.module:name' or 'path/to/file.py:name'")
    module = _load_file(where, what) if where.endswith(".py") or "/" in where else _import(where, what)
    found = getattr(module, name, None)
    if found is None:
        raise ValueError(f"{where!r} has no {name!r} (from {what} spec {spec!r})")
    return found


def _import(name: str, what: str) -> Any:
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name is not None and (name == e.name or name.startswith(e.name + ".")):  # not a dependency
            raise ValueError(f"cannot import {what} module {name!r}: {e}") from e
        raise


def _load_file(path: str, what: str) -> Any:
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"{what} file not found: {path}")
    module_spec = importlib.util.spec_from_file_location(f"rlflow_user_{file.stem}", file)
    if module_spec is None or module_spec.loader is None:
        raise ValueError(f"{what} file must be a .py file: {path}")
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module
