"""Reading a spec file: bounded, UTF-8, YAML without surprises. This module only parses.

``read_spec_yaml`` refuses, each with one line (``SpecFileError``), what ``yaml.safe_load`` lets
through or crashes on: a file over ``MAX_SPEC_BYTES``, bytes that are not UTF-8, a key given
twice in one mapping (PyYAML keeps the last one silently), and anchors/aliases that expand to more
than ``MAX_NODES`` nodes (a "billion laughs" bomb) or refer to themselves. Floats follow YAML 1.2,
so ``1e-3`` is the number a researcher means, not the string PyYAML 1.1 makes of it.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

MAX_SPEC_BYTES = 2**20  # a spec is a few kB; a larger file is a mistake, not a spec
MAX_NODES = 100_000  # YAML nodes after expanding aliases

_FLOAT_1_2 = re.compile(r"""^(?:
    [-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
  | [-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
  | [-+]?\.[0-9_]+(?:[eE][-+]?[0-9]+)?
  | [-+]?\.(?:inf|Inf|INF)
  | \.(?:nan|NaN|NAN))$""", re.X)


class SpecFileError(ValueError):
    """A spec file that cannot be read as a spec; ``str()`` is one line (without the path)."""


class _SpecLoader(yaml.SafeLoader):
    """``SafeLoader`` with YAML 1.2 floats and duplicate keys refused."""

    yaml_implicit_resolvers = {k: list(v) for k, v in
                               yaml.SafeLoader.yaml_implicit_resolvers.items()}

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: set = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if isinstance(key, list | dict):  # unhashable: let PyYAML say so
                continue
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


_SpecLoader.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT_1_2,
                                  list("-+0123456789."))


def _expanded_size(node: yaml.Node, limit: int) -> int:
    """Nodes of ``node``'s tree once every alias is expanded, counted up to ``limit``.

    Raises:
        SpecFileError: more than ``limit`` nodes, or an alias inside its own anchor.
    """
    sizes: dict[int, int] = {}
    open_: set[int] = set()

    def size(n: yaml.Node) -> int:
        if id(n) in sizes:
            return sizes[id(n)]
        if id(n) in open_:
            raise SpecFileError("a YAML alias refers to its own anchor (a recursive spec)")
        open_.add(id(n))
        total = 1
        if isinstance(n, yaml.SequenceNode):
            children = n.value
        elif isinstance(n, yaml.MappingNode):
            children = [c for pair in n.value for c in pair]
        else:
            children = []
        for child in children:
            total += size(child)
            if total > limit:
                raise SpecFileError(f"YAML aliases expand to more than {limit:,} nodes "
                                    "(an alias bomb?)")
        open_.discard(id(n))
        sizes[id(n)] = total
        return total

    return size(node)


def _parse(text: str) -> Any:
    """The data of one YAML document (``_SpecLoader``), or None for an empty one.

    Raises:
        SpecFileError: invalid YAML (with its line), a duplicate key, an alias bomb.
    """
    loader = None
    try:
        loader = _SpecLoader(text)
        node = loader.get_single_node()
        if node is None:
            return None
        _expanded_size(node, MAX_NODES)
        return loader.construct_document(node)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise SpecFileError(f"invalid YAML{where}: {problem}") from None
    except RecursionError:
        raise SpecFileError("YAML nested too deeply") from None
    finally:
        if loader is not None:
            loader.dispose()


def read_spec_yaml(path: str | Path) -> Any:
    """The data of the spec file at ``path`` (one YAML document; None when it is empty).

    Raises:
        SpecFileError: unreadable, larger than ``MAX_SPEC_BYTES``, not UTF-8, or bad YAML.
    """
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_SPEC_BYTES + 1)
    except OSError as e:
        raise SpecFileError(f"cannot read spec: {e.strerror}") from None
    if len(raw) > MAX_SPEC_BYTES:
        raise SpecFileError(f"larger than {MAX_SPEC_BYTES // 2**10} KiB, the most a spec may "
                            "be (is it a spec?)")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise SpecFileError(f"not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start})"
                            ) from None
    return _parse(text)
