"""The project's YAML reader (training configs and their overrides, cost recipes): plain data only, a key given
twice refused, and every error one line naming the file or override, the line and column."""

from __future__ import annotations

import re
from collections.abc import Hashable

import yaml

from diffusion.errors import ConfigError


class UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.safe_load``'s loader, refusing a key given twice in one mapping (PyYAML keeps the last one
    silently, so a second ``optimizer:`` section dropped the first); ``<<`` merges still override."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen = set()
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=deep)
                if not isinstance(key, Hashable):
                    continue  # SafeLoader's own construct_mapping refuses it
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"the key {key!r} is given twice in one mapping (the second would silently "
                                    f"replace the first)", key_node.start_mark)
                seen.add(key)
        return super().construct_mapping(node, deep)


def parse_yaml(text, where: str):
    """``yaml.safe_load`` (plain data: no tag builds a Python object), its errors as one line naming
    ``where``, the line and column, and what YAML found there."""
    try:
        return yaml.load(text, Loader=UniqueKeyLoader)
    except UnicodeDecodeError as e:
        raise ConfigError(f"{where}: not valid YAML: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f", line {mark.line + 1}, column {mark.column + 1}" if mark is not None and not where.startswith(
            "override") else ""
        problem = " ".join(str(getattr(e, "problem", None) or e).split())
        context = getattr(e, "context", None)
        if context and not isinstance(e, yaml.constructor.ConstructorError):
            problem = f"{' '.join(context.split())}: {problem}"
        tag = re.search(r"tag '([^']*)'", problem)
        if isinstance(e, yaml.constructor.ConstructorError) and tag:
            shown = tag.group(1).replace("tag:yaml.org,2002:", "!!")
            problem = (f"the tag {shown} is not allowed: a config holds plain values (numbers, strings, lists, "
                       f"mappings), never Python objects")
        raise ConfigError(f"{where}{at}: not valid YAML: {problem}") from None
