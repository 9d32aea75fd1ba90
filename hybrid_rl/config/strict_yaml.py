"""YAML that refuses a key given twice in one mapping, at any depth.

PyYAML keeps the last of two equal keys without a word, so a recipe with ``rollout:`` twice silently loses every
key of the first section. ``StrictLoader`` is PyYAML's ``SafeLoader`` whose ``construct_mapping`` raises
``DuplicateKeyError`` instead, naming the full dotted key and the lines of both. A key that a ``<<`` merge brings in
may still be overridden by the mapping's own key (that is what merging is for); only a mapping's own keys are
compared. Left out: every other YAML rule (the ``SafeLoader``'s, unchanged).
"""

from __future__ import annotations

from typing import Any

import yaml

_MERGE_TAG = "tag:yaml.org,2002:merge"


class DuplicateKeyError(yaml.YAMLError):
    """``key`` (dotted from the document's root) appears on ``first_line`` and again on ``second_line`` (1-based)."""

    def __init__(self, key: str, first_line: int, second_line: int):
        super().__init__(f"key '{key}' appears twice (lines {first_line} and {second_line})")
        self.key, self.first_line, self.second_line = key, first_line, second_line


class StrictLoader(yaml.SafeLoader):
    """``SafeLoader`` that raises ``DuplicateKeyError`` for a mapping key given twice."""

    def construct_document(self, node: yaml.Node) -> Any:
        self._paths: dict[int, str] = {}
        _label(node, "", self._paths)
        return super().construct_document(node)

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        if isinstance(node, yaml.MappingNode):
            self._check_unique(node)
        return super().construct_mapping(node, deep=deep)

    def _check_unique(self, node: yaml.MappingNode) -> None:
        prefix = getattr(self, "_paths", {}).get(id(node), "")
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == _MERGE_TAG:
                continue
            key, line = self.construct_object(key_node), key_node.start_mark.line + 1
            try:
                if key in seen:
                    raise DuplicateKeyError(f"{prefix}{key}", seen[key], line)
                seen[key] = line
            except TypeError:  # an unhashable key: the constructor reports it
                continue


def _label(node: yaml.Node, path: str, paths: dict[int, str]) -> None:
    """Record the dotted path of every mapping below ``node`` (``a.b.``, ``a.list[2].``) by the node's id."""
    if id(node) in paths:  # an alias: the first place it appears names it
        return
    if isinstance(node, yaml.MappingNode):
        paths[id(node)] = path
        for key_node, value_node in node.value:
            if isinstance(key_node, yaml.ScalarNode) and key_node.tag != _MERGE_TAG:
                _label(value_node, f"{path}{key_node.value}.", paths)
            else:
                _label(value_node, path, paths)
    elif isinstance(node, yaml.SequenceNode):
        paths[id(node)] = path
        for i, item in enumerate(node.value):
            _label(item, f"{path.rstrip('.')}[{i}].", paths)


def load_yaml(text: str) -> Any:
    """``yaml.safe_load(text)`` that raises ``DuplicateKeyError`` for a key given twice in one mapping."""
    return yaml.load(text, Loader=StrictLoader)  # noqa: S506 (a SafeLoader subclass)
