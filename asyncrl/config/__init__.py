"""Configuration, the ground floor: schema, loading, derived defaults, validation, placement parsing
(``placement``), the eval fleet's engine settings (``eval_engine``) and the resolved config as TOML
(``render``). Never imports torch, and nothing above it in ``asyncrl`` (docs/design.md)."""

from asyncrl.config.loader import apply_overrides, config_from_dict, load_config, to_dict
from asyncrl.config.schema import Config, ConfigError
from asyncrl.config.validate import validate

__all__ = ["Config", "ConfigError", "apply_overrides", "config_from_dict", "load_config", "to_dict", "validate"]
