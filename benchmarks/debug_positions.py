"""Localizes CUDA positions-mode errors: one simulated rank, schedule variants (debug tool)."""
import sys, os
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch
from types import SimpleNamespace
from nemo_cp_native import flint
from nemo_cp_native.attention import AttnMask, attn_forward
from nemo_cp_native.reference import magi as rm, cp_attention as rcp
from nemo_cp_native.reference.sink_attention import attention_positions_ref
from nemo_cp_native.testing_attention import doc_lengths, make_attention_case

g = torch.Generator().manual_seed(5)
lengths = doc_lengths(5000, "random", mean=900, generator=g)
cfg = SimpleNamespace(num_attention_heads=8, num_key_value_heads=2, head_dim=128, sliding_window=0, magi_chunk_size=512)
c = make_attention_case(lengths, 8, 2, 128, device="cuda", generator=g)
cu = c["cu_seqlens"].cpu()
cp = 2
plans = [flint._build_magi_plan(cu, cfg, flint.SimulatedGroup(cp, r)) for r in range(cp)]
mk = plans[0].keys[0]
idx = mk.local_token_global_indices.cuda()
T = c["q"].shape[0]
real = idx < T
q = c["q"].new_zeros((idx.numel(), 8, 128)); q[real] = c["q"][idx[real]]
kvpos = mk.kv_pos.long().cuda(); kr = kvpos < T
kb = c["k"].new_zeros((kvpos.numel(), 2, 128)); vb = c["v"].new_zeros((kvpos.numel(), 2, 128))
kb[kr] = c["k"][kvpos[kr]]; vb[kr] = c["v"][kvpos[kr]]
mask = mk.device_tables(q.device)["mask"]
ref, _ = attention_positions_ref(q.double(), kb.double(), vb.double(), c["sink"].double(), mask.q_pos, mask.q_lo, mask.k_pos)

def bad(out, name):
    err = (out.double() - ref).abs().amax(dim=(1, 2))
    b = (err > 0.05).nonzero().flatten()
    print(f"{name}: bad rows {b.numel()} first {b[:8].tolist()} tiles {sorted(set((b // 128).tolist()))[:10]}")
    return b

out, lse = attn_forward(q, kb, vb, c["sink"], mask, 128**-0.5)
b = bad(out, "plan schedule")
ent = mask.fwd_ent.clone() & ~1
out2, _ = attn_forward(q, kb, vb, c["sink"], AttnMask(q_pos=mask.q_pos, q_lo=mask.q_lo, k_pos=mask.k_pos, fwd_off=mask.fwd_off, fwd_ent=ent), 128**-0.5)
bad(out2, "no full flags")
n_q = mask.fwd_off.numel() - 1; n_k = (kb.shape[0] + 63) // 64
off = torch.arange(n_q + 1, dtype=torch.int32, device="cuda") * n_k
allent = (torch.arange(n_k, dtype=torch.int32, device="cuda") * 2).repeat(n_q)
out3, _ = attn_forward(q, kb, vb, c["sink"], AttnMask(q_pos=mask.q_pos, q_lo=mask.q_lo, k_pos=mask.k_pos, fwd_off=off, fwd_ent=allent), 128**-0.5)
bad(out3, "all tiles partial")
cpu_mask = AttnMask(q_pos=mask.q_pos.cpu(), q_lo=mask.q_lo.cpu(), k_pos=mask.k_pos.cpu(), fwd_off=mask.fwd_off.cpu(), fwd_ent=mask.fwd_ent.cpu())
out4, _ = attn_forward(q.cpu(), kb.cpu(), vb.cpu(), c["sink"].cpu(), cpu_mask, 128**-0.5)
bad(out4.cuda(), "cpu")
if b.numel():
    r = int(b[0]); t = r // 128
    print("row", r, "pos", int(mask.q_pos[r]), "lo", int(mask.q_lo[r]), "tile entries", mask.fwd_ent[mask.fwd_off[t]:mask.fwd_off[t+1]].tolist())
    print("kv_pos around", mask.k_pos[:8].tolist(), "Lkv", kb.shape[0], "L", q.shape[0])
