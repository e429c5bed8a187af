"""Configuration: schema, loading, derived defaults, validation. Never imports torch."""

from asyncrl.config.loader import apply_overrides, config_from_dict, load_config, to_dict
from asyncrl.config.schema import Config, ConfigError
from asyncrl.config.validate import validate

__all__ = ["Config", "ConfigError", "apply_overrides", "config_from_dict", "load_config", "to_dict", "validate"]
