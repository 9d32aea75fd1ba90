"""Execute a user's ``path/to/file.py`` as a module (plug-ins, reward functions)."""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path


def exec_file_module(path: Path, module_name: str) -> types.ModuleType | None:
    """Run the Python file ``path`` as the module ``module_name`` (a private name, so that the file cannot shadow an
    installed package of the same stem) and return it; None when the file cannot be loaded as Python. The module is
    in ``sys.modules`` while it runs and stays there, unless running it raised."""
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        return None
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(module_name, None)
        raise
    return module
