"""ptxas performance advisories that the build treats as errors (used by setup.py).

ptxas prints "(C75xx) Potential Performance Loss: wgmma.mma_async instructions are serialized ..."
when it cannot keep a kernel's wgmma pipeline asynchronous (too few registers for it: C7511;
control flow merging while an MMA is in flight: C7515; and their siblings). It then waits after
every wgmma of that kernel: the kernel still gives the right answer, at a fraction of its speed,
and nothing else would tell. Found while trying half-K P V tiles in the Hopper forward
(docs/EXPERIMENTS.md): a change that looks harmless can tip one instantiation over.
"""

from __future__ import annotations

import re

_ADVISORY = re.compile(r"\((C75\d\d)\) Potential Performance Loss: (wgmma[^\n]*?serialized[^\n]*?)"
                       r"(?: in the function '([^']+)')?\s*$", re.M)  # fmt: skip


def serialized_wgmma(ptxas_stderr: str) -> list[tuple[str, str]]:
    """``(code, kernel)`` for every advisory that says a function's wgmma are serialized."""
    return [(m.group(1), m.group(3) or "?") for m in _ADVISORY.finditer(ptxas_stderr)]
