"""A run's configuration: loaded from YAML or a dict, validated in one stage, with every
part resolved to its class (`loading.py`); per-GPU heterogeneity (`heterogeneity.py`)."""

from triosim.config.loading import Config, load_config

__all__ = ["Config", "load_config"]
