"""nemo-cp-native: native (C/CUDA) context-parallel data prep and learned-sink attention for
NeMo Automodel. Call ``nemo_cp_native.patch()`` to swap the Python modules it replaces."""

from ._ops import build_info, has_cuda
from .thd import thd_partition_indices
from . import mimo, reference

__version__ = "0.1.0"

__all__ = ["__version__", "build_info", "has_cuda", "mimo", "reference", "thd_partition_indices"]
