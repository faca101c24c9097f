"""hyperacc: fast and predictable synchronous distributed PyTorch training."""

__version__ = "0.1.0"
