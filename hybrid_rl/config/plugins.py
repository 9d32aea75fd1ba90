"""``import_plugins``: import the modules named in ``trainer.imports`` (or ``--import``) so their registrations run."""

from __future__ import annotations

import importlib
import types
from pathlib import Path

from hybrid_rl.config.errors import ConfigError
from hybrid_rl.pyfile import exec_file_module

_IMPORTED_FILES: dict[Path, types.ModuleType] = {}
"""Plug-in files already imported, by resolved path: a file is executed once per process, however often a config
naming it is loaded or validated."""


def import_plugins(modules: list[str] | tuple[str, ...], source: str = "trainer.imports") -> None:
    """Import each plug-in module (a module name, or ``path/to/file.py``) so that its registrations run.

    ``source`` is where the names came from (``trainer.imports`` or ``--import``), named in the error. A module
    already imported is not imported again. Raises ConfigError with one line naming the module and the fix.
    """
    for name in modules:
        if not isinstance(name, str) or not name.strip():
            raise ConfigError(f"{source}: {name!r} is not a module name or a path/to/file.py; fix {source}")
        name = name.strip()
        try:
            if name.endswith(".py"):
                path = Path(name).expanduser().resolve()
                if path in _IMPORTED_FILES:
                    continue
                if not path.is_file():
                    raise ConfigError(f"{source}: no such file {name!r}; fix the path in {source}")
                module = exec_file_module(path, f"hybrid_rl_plugin_{path.stem}")
                if module is None:
                    raise ConfigError(f"{source}: cannot load {name!r} as Python; give a .py file or a module name")
                _IMPORTED_FILES[path] = module
            else:
                importlib.import_module(name)
        except ConfigError:
            raise
        except ModuleNotFoundError as e:
            if e.name and (name == e.name or name.startswith(e.name + ".")):  # the plug-in itself is missing, not a module it imports
                raise ConfigError(f"{source}: cannot import module {name!r} ({_line(e)}); put its directory on "
                                  f"PYTHONPATH, give its file as path/to/{name.rsplit('.', 1)[-1]}.py, or fix {source}") from e
            raise ConfigError(f"{source}: importing {name!r} failed ({type(e).__name__}: {_line(e)}); install what it "
                              f"imports or fix that module") from e
        except Exception as e:  # the module exists but raised while importing (e.g. a duplicate registration)
            raise ConfigError(f"{source}: importing {name!r} failed ({type(e).__name__}: {_line(e)}); fix that "
                              f"module") from e


def _line(e: BaseException) -> str:
    """An exception's message on one line."""
    return " ".join(str(e).split()) or type(e).__name__
