"""specter-gguf: fast Mixture-of-Experts inference from GGUF files."""

from specter_gguf.errors import SpecterError

__all__ = ["SpecterError"]
__version__ = "0.1.0"
