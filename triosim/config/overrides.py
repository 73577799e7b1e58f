"""A config with fields overridden (`--set FIELD=VALUE`, a sweep's grid point): one rule for
both. Where an override selects another part of a section (`parallelism.mode: ddp` on a 3d
base, `topology.kind: ring` on a fat tree), the base's fields of that section that the new
part does not have (`dp`, `pp`, `radix`) are left out, and said (`dropped`); a field the
override itself names is never dropped, so a wrong one is still an error naming it.
"""

from __future__ import annotations

import copy
from pathlib import Path

from triosim.common.errors import ConfigError

# the field of a section that selects its part
SELECTORS = {"parallelism": "mode", "topology": "kind", "network": "kind", "perfmodel": "kind"}
# and of a section whose other fields it turns off (host.model off reads none of them)
SWITCHES = {**SELECTORS, "host": "model"}


def with_overrides(base: dict, overrides: dict, base_dir) -> tuple:
    """(Config, dropped field names) of `base` with `overrides` ({dotted field: value})
    applied (module docstring)."""
    from triosim.config.loading import from_dict, set_field

    data = copy.deepcopy(base)
    for k, v in overrides.items():
        set_field(data, k, v)
    dropped = []
    while True:
        try:
            return from_dict(data, base_dir=Path(base_dir)), tuple(dropped)
        except ConfigError as e:  # a base field of a part the overrides do not select?
            if not _drop(data, base, overrides, e.field):
                raise
            dropped.append(e.field)


def _drop(data: dict, base: dict, overrides: dict, dotted: str) -> bool:
    section, _, name = dotted.partition(".")
    selector = SWITCHES.get(section)
    key = f"{section}.{selector}"
    changed = key in overrides and overrides[key] != (base.get(section) or {}).get(selector)
    own = data.get(section)
    if not (changed and name and dotted not in overrides and isinstance(own, dict)):
        return False
    if name not in own:
        return False
    del own[name]
    return True
