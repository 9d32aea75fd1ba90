"""Reading a recipe: YAML, dotted overrides, strict coercion of every value to its field's type.

Loading is strict: an unknown key is an error naming its full dotted path and the closest valid one (or, for a key
that moved, its new place), a value of the wrong type is an error naming the key and the expected type, and a key
given twice in the recipe (at any depth) is an error naming the dotted key and both lines (``strict_yaml.py``).
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union

import yaml

from hybrid_rl.config.errors import ConfigError
from hybrid_rl.config.plugins import import_plugins
from hybrid_rl.config.registered import REGISTERED_KEYS, check_choice
from hybrid_rl.config.moved import MOVED_KEYS, REMOVED_KEYS
from hybrid_rl.config.strict_yaml import DuplicateKeyError, load_yaml
from hybrid_rl.config.tree import Config


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Read a recipe YAML (or defaults when ``path`` is None) and apply ``key.sub=value`` overrides."""
    raw: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.exists():
            raise ConfigError(_missing_recipe(str(path)))
        try:
            raw = load_yaml(p.read_text()) or {}
        except DuplicateKeyError as e:
            raise ConfigError(f"recipe {str(path)!r}: {e}, and only the second would count; keep one "
                              f"of them (merge the two into one)") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"recipe {str(path)!r} is not valid YAML: {_yaml_problem(e)}; fix the syntax "
                              f"there") from e
        if not isinstance(raw, dict):
            raise ConfigError(f"recipe {str(path)!r} must be a mapping of sections (model, data, ...)")
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} must look like key.sub=value (e.g. trainer.total_steps=10)")
        _set_dotted(raw, key.strip(), _parse_scalar(value, key.strip()))
    trainer = raw.get("trainer")
    if isinstance(trainer, dict) and "imports" in trainer:  # plug-ins register their names before the keys are checked
        import_plugins(_coerce(list[str], trainer["imports"], "trainer.imports"), "trainer.imports")
    return _build(Config, raw, "")


RECIPES_DIR = Path(__file__).resolve().parents[2] / "recipes"
"""The recipes of the checkout (``make train RECIPE=<name>`` runs ``recipes/<name>.yaml``)."""


def _missing_recipe(path: str) -> str:
    """A missing recipe's line, naming the recipes there (in the folder ``path`` names, else the checkout's)."""
    folder = Path(path).parent
    if not folder.is_dir() or not any(folder.glob("*.yaml")):
        folder = RECIPES_DIR
    names = sorted(p.stem for p in folder.glob("*.yaml"))
    if not names:
        return f"recipe {path!r} does not exist; pass the path of a recipe YAML file"
    try:
        shown = str(folder.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        shown = str(folder)
    example = "cpu_successor" if "cpu_successor" in names else names[0]  # the CPU default, where it is there
    return (f"recipe {path!r} does not exist; the recipes in {shown}/ are {', '.join(names)}: pick one by name "
            f"(make train RECIPE={example}) or pass its file ({shown}/{example}.yaml)")


def _yaml_problem(e: yaml.YAMLError) -> str:
    """PyYAML's error on one line, each part with its line and column (1-based, as editors count them)."""
    if not isinstance(e, yaml.MarkedYAMLError):
        return " ".join(str(e).split())
    parts = []
    for what, mark in ((e.context, e.context_mark), (e.problem, e.problem_mark)):
        if what:
            parts.append(f"line {mark.line + 1}, column {mark.column + 1}: {what}" if mark is not None else what)
    return "; ".join(parts) or " ".join(str(e).split())


def save_config(cfg: Config, path: str | Path) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))


def all_keys(cls: type = Config, prefix: str = "") -> list[str]:
    """Every valid dotted key (sections and leaves)."""
    out = []
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        out.append(key)
        if dataclasses.is_dataclass(f.type if isinstance(f.type, type) else _resolve(cls, f.name)):
            out.extend(all_keys(_resolve(cls, f.name), key + "."))
    return out


def _parse_scalar(text: str, key: str = "") -> Any:
    # YAML rules give ints, floats, bools, null and [lists] the way recipes spell them.
    try:
        return load_yaml(text)
    except DuplicateKeyError as e:
        raise ConfigError(f"override {key}={text}: key '{key}.{e.key}' is given twice; give it once") from None
    except yaml.YAMLError:
        return text


def _set_dotted(raw: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    node = raw
    for i, part in enumerate(parts[:-1]):
        nxt = node.setdefault(part, {})
        if not isinstance(nxt, dict):
            raise ConfigError(f"override {key}: {'.'.join(parts[:i + 1])} is a value, not a section")
        node = nxt
    node[parts[-1]] = value


def _resolve(cls: type, name: str) -> Any:
    return typing.get_type_hints(cls)[name]


def _unknown(key: str) -> ConfigError:
    if key in MOVED_KEYS:
        return ConfigError(f"{key} is now {MOVED_KEYS[key]}; rename it in the recipe or override")
    removed = REMOVED_KEYS
    if key in removed:
        return ConfigError(f"{key} was {removed[key]}")
    close = difflib.get_close_matches(key, all_keys(), n=1, cutoff=0.6)
    hint = f"; did you mean '{close[0]}'?" if close else "; see hybrid_rl/config/ for the valid keys"
    return ConfigError(f"unknown config key '{key}'{hint}")


def _build(cls: type, raw: Any, prefix: str) -> Any:
    if not isinstance(raw, dict):
        raise ConfigError(f"'{prefix.rstrip('.')}' must be a section (a mapping), got {raw!r}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for key in raw:
        if key not in names:
            raise _unknown(f"{prefix}{key}")
    kwargs = {}
    for name in names:
        if name not in raw:
            continue
        kwargs[name] = _coerce(hints[name], raw[name], f"{prefix}{name}")
        if f"{prefix}{name}" in REGISTERED_KEYS:
            check_choice(f"{prefix}{name}", kwargs[name])
    return cls(**kwargs)


def _coerce(tp: Any, value: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, key + ".")
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        lists = [a for a in inner if typing.get_origin(a) is list]
        if isinstance(value, list) and lists:  # ``str | list[str]``: a list where the value is one
            return _coerce(lists[0], value, key)
        return _coerce(inner[0], value, key)
    if origin is Literal:
        if value not in args:
            close = difflib.get_close_matches(str(value), [str(a) for a in args], n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise ConfigError(f"{key}={value!r} is not one of {list(args)}{hint}")
        return value
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key} must be a mapping (key: value), got {value!r}")
        return dict(value)
    if origin is list:
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, list):
            raise ConfigError(f"{key} must be a list, got {value!r}")
        return [_coerce(args[0], v, f"{key}[{i}]") for i, v in enumerate(value)]
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key} must be true or false, got {value!r}")
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            raise ConfigError(f"{key} must be an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            if isinstance(value, str):
                try:
                    return float(value)  # YAML 1.1 reads "1e-6" as a string
                except ValueError:
                    pass
            raise ConfigError(f"{key} must be a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise ConfigError(f"{key} must be a string, got {value!r}")
        return str(value)
    return value
