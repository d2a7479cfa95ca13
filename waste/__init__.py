"""waste: the Python research workbench of the WASTE inference engine."""

from waste.config import ModelConfig, load_config_file, load_preset, parse_config

__version__ = "0.1.0"
__all__ = ["ModelConfig", "load_config_file", "load_preset", "parse_config", "__version__"]
