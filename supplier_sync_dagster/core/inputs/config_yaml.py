"""An operator's YAML file (``suppliers.yaml``), read strictly: what it cannot hold is refused
before anything builds a value from it.

PyYAML's safe loader shares the object of an anchor with every alias to it, so an "alias
bomb" (nine aliases of nine aliases of ...) loads at once into a small graph, and only
expands when something walks it as a tree: a validation error's message, a ``repr``, a
traceback that Dagster serializes when the code location's definitions load fails. A
configuration file has no use for them, so :func:`read_yaml_file` scans the file's events
first and refuses:

- a file over :data:`MAX_YAML_BYTES`, or not UTF-8;
- any anchor (``&name``) or alias (``*name``), and so any merge of one (``<<: *name``);
- nesting deeper than :data:`MAX_YAML_DEPTH`;
- a key given twice in one mapping (at any level: YAML keeps the last silently);
- more than one document, a tag the safe loader does not know, or a syntax error.

Each refusal is one line naming the file and the line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from supplier_sync_dagster.core.errors import ConfigError

MAX_YAML_BYTES = 1 << 20
MAX_YAML_DEPTH = 32
# libyaml's parser when PyYAML has it: a code location reads the file once per module.
_LOADER: type[yaml.SafeLoader] = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_MERGE_TAG = "tag:yaml.org,2002:merge"


def read_yaml_file(path: Path, *, what: str, max_bytes: int = MAX_YAML_BYTES) -> Any:
    """The one document of the YAML file at ``path``, read strictly (the module says how).

    Args:
        path: The file.
        what: What the file is, for the messages ("suppliers file").
        max_bytes: The largest file accepted.

    Returns:
        The document's value (None for an empty file).

    Raises:
        ConfigError: The file cannot be read, is too large, is not YAML, or holds an anchor,
            an alias, a duplicate key or nesting too deep; one line, naming the file and line.
    """
    try:
        with path.open("rb") as stream:
            raw = stream.read(max_bytes + 1)
    except OSError as err:
        raise ConfigError(f"{path}: cannot read the {what}: {err.strerror or err}") from None
    if len(raw) > max_bytes:
        raise ConfigError(f"{path}: the {what} is larger than {max_bytes} bytes")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path}: the {what} is not UTF-8 text (byte {err.start})") from None
    try:
        return _load(text, str(path))
    except yaml.MarkedYAMLError as err:
        where = f" (line {err.problem_mark.line + 1})" if err.problem_mark else ""
        problem = " ".join(filter(None, (err.context, err.problem)))
        raise ConfigError(f"{path}: not YAML: {problem}{where}") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not YAML: {' '.join(str(err).split())}") from None


def _load(text: str, source: str) -> Any:
    _refuse_references(text, source)
    loader = _LOADER(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _refuse_duplicate_keys(loader, node, source, "")
        return loader.construct_document(node)
    finally:
        loader.dispose()


def _refuse_references(text: str, source: str) -> None:
    # Events only: no node, no value, so nothing is expanded or even shared yet.
    depth = 0
    for event in yaml.parse(text, Loader=_LOADER):
        line = event.start_mark.line + 1 if event.start_mark else 0
        anchor: str | None = getattr(event, "anchor", None)
        if anchor is not None:
            kind = "alias *" if isinstance(event, yaml.AliasEvent) else "anchor &"
            raise ConfigError(
                f"{source}: line {line}: YAML {kind}{_short(anchor)} refused: "
                "write each value out (no anchors or aliases)"
            )
        if isinstance(event, yaml.CollectionStartEvent):
            depth += 1
            if depth > MAX_YAML_DEPTH:
                raise ConfigError(
                    f"{source}: line {line}: nested deeper than {MAX_YAML_DEPTH} levels"
                )
        elif isinstance(event, yaml.CollectionEndEvent):
            depth -= 1


def _refuse_duplicate_keys(
    loader: yaml.SafeLoader, node: yaml.Node, source: str, where: str
) -> None:
    # The tree has no alias (refused above), so each node is visited once.
    if isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            _refuse_duplicate_keys(loader, item, source, f"{where}[{index}]")
    if not isinstance(node, yaml.MappingNode):
        return
    seen: dict[Any, int] = {}
    for key_node, value_node in node.value:
        if not isinstance(key_node, yaml.ScalarNode):
            continue  # the constructor refuses a key it cannot hash
        key = "<<" if key_node.tag == _MERGE_TAG else loader.construct_object(key_node)
        line = key_node.start_mark.line + 1
        if key in seen:
            place = f" in {where}" if where else ""
            raise ConfigError(
                f"{source}: line {line}: duplicate key {_short(str(key))!r}{place} "
                f"(first at line {seen[key]}): give each key once"
            )
        seen[key] = line
        child = f"{where}.{key}" if where else str(key)
        _refuse_duplicate_keys(loader, value_node, source, child)


def _short(text: str, most: int = 60) -> str:
    return text if len(text) <= most else f"{text[:most]}..."


__all__ = ["MAX_YAML_BYTES", "MAX_YAML_DEPTH", "read_yaml_file"]
