"""nemo-cp-native: native (C/CUDA) context-parallel data prep and learned-sink attention for
NeMo Automodel. Call ``nemo_cp_native.patch()`` to swap the Python modules it replaces."""

from ._ops import build_info, has_cuda
from .thd import thd_partition_indices
from .attention import sink_attention
from . import flint, mimo, reference
from .patch import patch, patched, unpatch

__version__ = "0.1.0"

__all__ = [
    "__version__",
    "build_info",
    "flint",
    "has_cuda",
    "mimo",
    "patch",
    "patched",
    "reference",
    "sink_attention",
    "thd_partition_indices",
    "unpatch",
]
