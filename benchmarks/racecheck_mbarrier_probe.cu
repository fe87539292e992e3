/*
 * racecheck_mbarrier_probe.cu: does compute-sanitizer racecheck model mbarrier arrive/wait as
 * synchronization? Two warps hand a shared buffer back and forth through two mbarriers, the
 * pattern the sm90 dK/dV kernel uses for lse/Delta (writer: stores, __syncwarp, lane 0 arrives on
 * `full`; readers: every lane waits on `full`, loads, __syncwarp, lane 0 arrives on `empty`;
 * the writer waits on `empty` before the next round). The program is race-free by construction;
 * hazards reported on it are the tool's, not ours.
 *
 *   nvcc -arch=sm_90a -o build/racecheck_mbarrier_probe benchmarks/racecheck_mbarrier_probe.cu
 *   compute-sanitizer --tool racecheck build/racecheck_mbarrier_probe
 */
#include <cstdint>
#include <cstdio>

__device__ __forceinline__ void arrive(uint32_t bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void wait(uint32_t bar, uint32_t parity) {
    uint32_t done;
    do {
        asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
                     : "=r"(done)
                     : "r"(bar), "r"(parity)
                     : "memory");
    } while (!done);
}

__global__ void probe(float *out, int rounds) {
    __shared__ float buf[64];
    __shared__ __align__(8) uint64_t bars[2];
    const uint32_t full = (uint32_t)__cvta_generic_to_shared(&bars[0]), empty = full + 8;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (threadIdx.x == 0) {
        asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(full));
        asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(empty));
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
    float acc = 0.f;
    for (int r = 0; r < rounds; ++r) {
        if (warp == 0) {
            if (r > 0) wait(empty, (r - 1) & 1);
            buf[lane] = r + lane;
            buf[lane + 32] = r - lane;
            __syncwarp();
            if (lane == 0) arrive(full);
        } else {
            wait(full, r & 1);
            acc += buf[lane] + buf[63 - lane];
            __syncwarp();
            if (lane == 0) arrive(empty);
        }
    }
    if (warp == 1) out[lane] = acc;
}

int main() {
    float *out = nullptr;
    if (cudaMalloc(&out, 32 * sizeof(float)) != cudaSuccess) return 1;
    probe<<<1, 64>>>(out, 8);
    cudaError_t e = cudaDeviceSynchronize();
    float h[32];
    cudaMemcpy(h, out, sizeof(h), cudaMemcpyDeviceToHost);
    /* buf[63 - lane] = r - (31 - lane): per round 2r + 2 lane - 31, over r = 0..7 */
    int bad = 0;
    for (int i = 0; i < 32; ++i) bad += h[i] != 2.f * 28 + 8.f * (2 * i - 31);
    printf("racecheck_mbarrier_probe: %s, %d wrong values\n", cudaGetErrorString(e), bad);
    cudaFree(out);
    return (e != cudaSuccess || bad) ? 1 : 0;
}
