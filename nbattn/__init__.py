"""nbattn: FlashInfer's attention ideas as a NumPy golden model and numba.cuda kernels.

Import order matters: :mod:`nbattn._compat` runs before anything imports
``numba.cuda`` (numpy-2.5 shim, simulator choice).
"""
from ._compat import BACKEND, simulator_enabled  # must stay first

__version__ = "0.1.0"
__all__ = ["BACKEND", "simulator_enabled", "__version__"]
