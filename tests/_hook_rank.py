"""One torchrun rank of ``test_patch_hook.py``: started with ``NCP_PATCH=1`` and nothing else.

The script never calls ``nemo_cp_native.patch()``. It imports upstream's MiMo ``cp`` module the
way a recipe does, then shards a packed batch over a real 2-rank gloo mesh with upstream's name,
and writes what it saw to ``$NCP_HOOK_OUT/rank<r>.json``.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

hook_loaded_at_start = "nemo_cp_native_hook" in sys.modules
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))

import nemo_automodel.components.models.mimo_v2_flash.cp as upstream_cp  # noqa: E402 - the hook fires here

import nemo_cp_native.mimo as native  # noqa: E402
from nemo_cp_native.reference import mimo as ref  # noqa: E402
from nemo_cp_native.testing import make_mimo_batch  # noqa: E402

batch = make_mimo_batch(2, 8 * world, num_chunks=1, cp_size=world, generator=torch.Generator().manual_seed(7))
_, got, _ = upstream_cp.shard_batch_for_mimo_te(mesh, None, dict(batch), image_token_id=5)
path = native.fast_path_info()["path"]
_, want, _ = ref.shard_batch_for_mimo_te(mesh, None, dict(batch), image_token_id=5)
same = list(got) == list(want) and all(
    torch.equal(got[k], want[k]) if isinstance(want[k], torch.Tensor) else got[k] == want[k] for k in want
)
result = {
    "rank": rank,
    "env_rank": os.environ.get("RANK"),
    "hook_loaded_at_start": hook_loaded_at_start,
    "native_name": upstream_cp.shard_batch_for_mimo_te is native.shard_batch_for_mimo_te,
    "path": path,
    "same_as_reference": same,
}
with open(os.path.join(os.environ["NCP_HOOK_OUT"], f"rank{rank}.json"), "w") as f:
    json.dump(result, f)
dist.barrier()
dist.destroy_process_group()
