/*
 * sink_attn/dispatch.cu: the one dispatcher of the sink-attention kernels. It alone maps (device
 * capability, mask policy, head dim, dtype, deterministic, test hooks) to kernels, and it alone
 * answers how large the backward workspace is and how it is carved; the kernel files hold kernels
 * and launchers only.
 *
 *   forward   Hopper (sm90_fwd.cu) on compute capability 9.0 with an sm_90a build, else the
 *             portable mma.sync kernel (portable_fwd.cu)
 *   backward  pre-pass (Delta, dsink; on Hopper the grids' longest-first tile orders) always;
 *             then on Hopper the dK/dV kernel with dQ added atomically into an fp32 workspace
 *             (default) or the deterministic dK/dV + dQ pair (asked for, or D = 128 with a
 *             small window on a device of little memory bandwidth: dq_kernel_pays); elsewhere
 *             the portable (deterministic) kernels
 * The test hooks (ncp_attn_debug: portable kernels, persistent grid size, whole tiles, backward
 * orders) are one struct set from Python and read once per call; no environment variable is read
 * here.
 * Test: pytest tests/test_sink_attention_cuda.py
 */
#include <algorithm>
#include <atomic>

#include "../sm90/arch.cuh"
#include "attn_args.h"
#include "launch.h"

namespace ncp {
namespace {

std::atomic<int> g_portable{0}, g_grid{0}, g_whole_tiles{0}, g_order_waves{0};

int sm_count(int dev) {
    static int cached[kMaxDevices];
    if (dev < kMaxDevices && cached[dev] > 0) return cached[dev];
    int n = 0;
    if (cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess) return 0;
    if (dev < kMaxDevices) cached[dev] = n;
    return n;
}

/* Peak memory bandwidth per SM per SM clock (bytes) of device dev, 0 when unknown: about 12.8 on an
 * H100 SXM (3.35 TB/s), 18 on an H200 (4.8 TB/s), both 132 SMs at 1.98 GHz. Asked once per device
 * (an unknown answer is cached too, as -1: a backward must not query the runtime every call). */
double mem_bytes_per_sm_clock(int dev) {
    static double cached[kMaxDevices];
    if (dev < kMaxDevices && cached[dev] != 0) return cached[dev] > 0 ? cached[dev] : 0.0;
    int mem_khz = 0, bus_bits = 0, sm_khz = 0;
    const int sms = sm_count(dev);
    double v = -1.0;
    if (cudaDeviceGetAttribute(&mem_khz, cudaDevAttrMemoryClockRate, dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&bus_bits, cudaDevAttrGlobalMemoryBusWidth, dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&sm_khz, cudaDevAttrClockRate, dev) != cudaSuccess)
        cudaGetLastError(); /* a refused attribute is not sticky: clear it so no later check reports it */
    else if (sms > 0 && mem_khz > 0 && bus_bits > 0 && sm_khz > 0)
        v = 2.0 * mem_khz * (bus_bits / 8) / ((double)sms * sm_khz); /* double data rate */
    if (dev < kMaxDevices) cached[dev] = v;
    return v > 0 ? v : 0.0;
}

/* Whether the deterministic pair (dK/dV kernel + dQ kernel, 7 MMAs per tile against 5) is faster
 * than the atomic-dQ kernel, so a call that did not ask for determinism takes it too. The atomic
 * path pays two memory passes per query row (zeroing the fp32 dQ accumulator, converting it), the
 * pair two more MMAs per visible tile: the pair wins where a row sees few keys on a device of
 * little memory bandwidth per unit of compute. Measured (BENCHMARKS.md, docs/EXPERIMENTS.md):
 * D = 128, window 128, 8k documents, 32/8 heads: the pair 9-13% faster forward+backward on the
 * H100 SXM in five runs, 1-6% slower on the H200 in six; window 513: slower on both; D = 64,
 * window 128 (gpt-oss): slower on both. H100 window sweep (32/4 and 32/8 heads, 8k and 2k
 * documents, forward+backward time of the pair against the atomic kernel): window 192 -2.1% to
 * -3.4%, 256 +1.1% to +1.2%, 320 +3.6% to +6.4%, 384 and 448 +8% to +10%: the limit is the
 * largest measured window where the pair wins. */
constexpr int kDqKernelMaxWindow = 192;
constexpr double kDqKernelMaxBytesPerSmClock = 15.0;
bool dq_kernel_pays(int dev, int D, int window) {
    if (D != 128 || window <= 0 || window > kDqKernelMaxWindow) return false;
    const double b = mem_bytes_per_sm_clock(dev);
    return b > 0 && b < kDqKernelMaxBytesPerSmClock;
}

/* The decisions of one call on the current device. */
struct choice {
    attn_config cfg;
    bool sm90;      /* Hopper kernels */
    bool atomic_dq; /* backward: dQ by atomic reductions (Hopper, not deterministic, dq_kernel_pays false) */
};

/* D and window: the call's head dim and mask window (0: none; tables: the window hint). */
ncp_status choose(int deterministic, int D, int window, choice *c) {
    int dev = 0;
    NCP_CUDA_CHECK(cudaGetDevice(&dev));
    const ncp_attn_debug d = ncp_attn_debug_get();
    c->cfg.device = dev;
    c->cfg.sm_count = sm_count(dev);
    c->cfg.grid = d.grid;
    c->cfg.whole_tiles = d.whole_tiles;
    /* Under a window every key tile sees about the same number of q tiles (only a document's last
     * few see fewer), and index order keeps neighbouring key tiles, which share Q, dO and dQ tiles,
     * in flight together: with the one-search producer (CtaKeyBounds) the w513 backward took 1.9%
     * (2k documents) and 1.1% (8k) less time in index order than longest first, and a CP rank's w513
     * tables -0.6% / +0.1% (H100, benchmarks/bench_bwd_order.py, docs/EXPERIMENTS.md). Without a
     * window (causal documents, a causal CP rank's tables) longest first stays: index order costs a
     * causal rank of cp = 8 up to 17% there. */
    c->cfg.order_waves = d.order_waves != 0 ? d.order_waves : (window > 0 ? -1 : kOrderWaves);
    c->sm90 = !d.portable && ncp_sm90_usable();
    c->atomic_dq = c->sm90 && !deterministic && !dq_kernel_pays(dev, D, window);
    return NCP_OK;
}

int32_t tiles_of(int32_t rows, int tile) { return rows <= 0 ? 0 : (int32_t)(((int64_t)rows + tile - 1) / tile); }

/* Byte offsets of the backward workspace's parts (each 256-byte aligned) and its total: Delta,
 * dsink partials, the Hopper grids' tile work and orders (dK/dV always, dQ when deterministic),
 * the atomic-dQ accumulator and, with D = 128, its tiles' claim flags. */
struct ws_layout {
    int64_t delta, part, kv, q, acc, flag, total;
    int32_t n_part, n_kv, n_q;
};
ws_layout layout_of(int32_t Tq, int32_t Tk, int32_t Hq, int32_t D, bool has_sink, const choice &c) {
    auto up = [](int64_t x) { return (x + 255) / 256 * 256; };
    ws_layout w;
    w.n_part = Tq <= 0 ? 1 : (int32_t)(((int64_t)Tq + kPreRows - 1) / kPreRows);
    w.n_kv = c.sm90 ? tiles_of(Tk, kBwdKvTile) : 0;
    w.n_q = c.sm90 && !c.atomic_dq ? tiles_of(Tq, kBwdQTile) : 0;
    w.delta = 0;
    w.part = up((int64_t)Hq * Tq * 4);
    w.kv = w.part + (has_sink ? up((int64_t)Hq * w.n_part * 4) : 0);
    w.q = w.kv + up((int64_t)w.n_kv * 8);
    w.acc = w.q + up((int64_t)w.n_q * 8);
    w.flag = w.acc + (c.atomic_dq ? (int64_t)Hq * ((Tq + 63) / 64) * 64 * D * 4 : 0);
    w.total = w.flag + (c.atomic_dq && D == 128 ? up((int64_t)Hq * ((Tq + 63) / 64) * (D / 64) * 4) : 0);
    return w;
}

/* The order of a grid of n tiles x `heads` CTAs, carved at byte offset off (work, then order);
 * none (index order) when the hook asks for it. */
tile_order carve_order(char *base, int64_t off, int32_t n, int32_t heads, const attn_config &cfg) {
    tile_order o;
    const bool on = n > 0 && cfg.order_waves > 0;
    o.n = on ? n : 0;
    o.work = on ? reinterpret_cast<int32_t *>(base + off) : nullptr;
    o.order = on ? o.work + n : nullptr;
    const int64_t chunk = (int64_t)cfg.order_waves * (cfg.sm_count > 0 ? cfg.sm_count : 1) / (heads > 0 ? heads : 1);
    o.chunk = (int32_t)std::max<int64_t>(1, std::min<int64_t>(chunk, n)); /* tiles per chunk, in [1, max(n, 1)] */
    return o;
}

}  // namespace
}  // namespace ncp

extern "C" void ncp_attn_debug_set(const ncp_attn_debug *d) {
    ncp::g_portable = d->portable;
    ncp::g_grid = d->grid;
    ncp::g_whole_tiles = d->whole_tiles;
    ncp::g_order_waves = d->order_waves;
}

extern "C" ncp_attn_debug ncp_attn_debug_get(void) {
    ncp_attn_debug d;
    d.portable = ncp::g_portable;
    d.grid = ncp::g_grid;
    d.whole_tiles = ncp::g_whole_tiles;
    d.order_waves = ncp::g_order_waves;
    return d;
}

extern "C" void ncp_sink_attn_kernels(int32_t deterministic, int32_t D, int32_t window, const char **fwd,
                                      const char **bwd) {
    ncp::choice c;
    if (ncp::choose(deterministic, D, window, &c) != NCP_OK) {
        *fwd = *bwd = "none";
        return;
    }
    *fwd = c.sm90 ? "sm90" : "portable";
    *bwd = c.sm90 ? (c.atomic_dq ? "sm90-atomic-dq" : "sm90-deterministic") : "portable";
}

extern "C" int64_t ncp_sink_attn_bwd_workspace(int32_t Tq, int32_t Tk, int32_t Hq, int32_t D, int32_t has_sink,
                                               int32_t deterministic, int32_t window) {
    ncp::choice c;
    if (ncp::choose(deterministic, D, window, &c) != NCP_OK) return 0;
    return ncp::layout_of(Tq, Tk, Hq, D, has_sink != 0, c).total;
}

extern "C" ncp_status ncp_sink_attn_fwd_cuda(const ncp_sink_attn_params *p, void *stream) {
    NCP_TRY(ncp_sink_attn_validate(p, 1));
    if (p->Tq == 0) return NCP_OK;
    ncp::choice c;
    NCP_TRY(ncp::choose(0, p->D, p->mask.window, &c));
    cudaStream_t s = (cudaStream_t)stream;
    return c.sm90 ? ncp::attn_fwd_sm90(*p, c.cfg, s) : ncp::attn_fwd_portable(*p, s);
}

extern "C" ncp_status ncp_sink_attn_bwd_cuda(const ncp_sink_attn_bwd_params *b, void *stream) {
    NCP_TRY(ncp_sink_attn_bwd_validate(b, 1));
    const ncp_sink_attn_params &p = b->f;
    if (p.Tq == 0 && p.Tk == 0) return NCP_OK;
    ncp::choice c;
    NCP_TRY(ncp::choose(b->deterministic, p.D, p.mask.window, &c));
    const ncp::ws_layout w = ncp::layout_of(p.Tq, p.Tk, p.Hq, p.D, p.sink != nullptr, c);
    NCP_ARG_CHECK(b->workspace != nullptr && b->workspace_bytes >= w.total,
                  "workspace must hold %lld bytes for this backward (ncp_sink_attn_bwd_workspace); got %lld",
                  (long long)w.total, (long long)b->workspace_bytes);
    char *base = static_cast<char *>(b->workspace);
    ncp::bwd_workspace ws;
    ws.delta = reinterpret_cast<float *>(base + w.delta);
    ws.dsink_part = p.sink != nullptr ? reinterpret_cast<float *>(base + w.part) : nullptr;
    ws.n_part = w.n_part;
    ws.dq_accum = c.atomic_dq && p.Tq > 0 ? reinterpret_cast<float *>(base + w.acc) : nullptr;
    ws.dq_flag = ws.dq_accum != nullptr && p.D == 128 ? reinterpret_cast<int32_t *>(base + w.flag) : nullptr;
    ws.kv = ncp::carve_order(base, w.kv, w.n_kv, p.Hkv, c.cfg);
    ws.q = ncp::carve_order(base, w.q, w.n_q, p.Hq, c.cfg);
    cudaStream_t s = (cudaStream_t)stream;
    NCP_TRY(ncp::attn_bwd_prepass(*b, ws, s));
    return c.sm90 ? ncp::attn_bwd_sm90(*b, ws, c.cfg, s) : ncp::attn_bwd_portable(*b, ws, s);
}
