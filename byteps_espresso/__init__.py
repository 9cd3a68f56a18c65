"""byteps-espresso: Espresso's per-tensor gradient-compression strategies for PyTorch.

Drop-in for BytePS: ``import byteps_espresso.torch as bps``.
"""

__version__ = "0.1.0"
__all__ = ["__version__"]
