"""Registries of pluggable parts keyed by plain strings, so configs, the CLI and sweeps name
parts without imports ("packet", "regression", "ddp", "mesh2d", ...).

A part may carry an `Options` dataclass (see triosim.common.schema): the fields a config may set
for it. Registering a name twice is an error unless `replace=True` says it is meant.
"""

from __future__ import annotations

from triosim.common.errors import ConfigError


class Registry:
    """A name -> part table; an unknown name is a ConfigError listing the known ones."""

    def __init__(self, field: str, attribute: str, what: str):
        self.field = field  # the config field that names a part, for error messages
        self.attribute = attribute  # attribute set on the part to its registered name
        self.what = what  # "network", "parallelism mode", ... for messages
        self._parts: dict[str, object] = {}

    def register(self, name: str, part=None, *, replace: bool = False):
        """`register(name, part)`, or `@register(name)` as a decorator."""
        if not isinstance(name, str) or not name:
            raise ConfigError(self.field, name, f"a non-empty string naming the {self.what}")

        def deco(obj):
            if name in self._parts and self._parts[name] is not obj and not replace:
                raise ConfigError(
                    self.field,
                    name,
                    f"a name not yet registered for a "
                    f"{self.what} (pass replace=True to replace it)",
                )
            self._parts[name] = obj
            setattr(obj, self.attribute, name)
            return obj

        return deco if part is None else deco(part)

    def get(self, name):
        if name not in self._parts:
            raise ConfigError(self.field, name, f"one of {', '.join(sorted(self._parts))}")
        return self._parts[name]

    def names(self) -> list[str]:
        return sorted(self._parts)

    def items(self):
        return sorted(self._parts.items())

    def __contains__(self, name) -> bool:
        return name in self._parts
