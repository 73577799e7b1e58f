"""Registries of pluggable parts keyed by plain strings, so configs, the CLI and sweeps name
parts without imports ("packet", "regression", "ddp", ...)."""

from __future__ import annotations

from triosim.errors import ConfigError


class Registry:
    """A name -> class table; an unknown name is a ConfigError listing the known ones."""

    def __init__(self, field: str, attribute: str):
        self.field = field  # the config field that names a part, for error messages
        self.attribute = attribute  # class attribute set to the registered name
        self._classes: dict[str, type] = {}

    def register(self, name: str):
        def deco(cls):
            self._classes[name] = cls
            setattr(cls, self.attribute, name)
            return cls

        return deco

    def get(self, name: str) -> type:
        if name not in self._classes:
            raise ConfigError(self.field, name, f"one of {', '.join(sorted(self._classes))}")
        return self._classes[name]

    def names(self) -> list[str]:
        return sorted(self._classes)
