// Does generic compressible memory make the dQ accumulator's zeroing and first touch cheaper?
// Run: OUT=$OUT bash benchmarks/gpu_run.sh compress (or nvcc -arch=sm_90a -O2 -o probe_compress benchmarks/probe_compress.cu -lcuda)
// Result (H100, 2026-12-06): benchmarks/results/2026-12-06_probe_compress_h100.txt; docs/EXPERIMENTS.md
#include <cuda.h>
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <algorithm>
#define CK(x) do { auto e_ = (x); if (e_ != 0) { printf("error %d at %s:%d\n", (int)e_, __FILE__, __LINE__); exit(1); } } while (0)

__global__ void zero_k(float4 *p, size_t n) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
    p[i] = make_float4(0, 0, 0, 0);
}
// each element gets `adds` additions of a nonzero value (like the bulk reductions), via red.global.add
__global__ void add_k(float *p, size_t n, int adds) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
    for (int a = 0; a < adds; ++a) atomicAdd(p + i, 1e-3f * (float)((i + a) & 255));
}
__global__ void convert_k(const float4 *p, uint2 *o, size_t n) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    float4 v = p[i];
    __nv_bfloat162 a = __floats2bfloat162_rn(v.x, v.y), b = __floats2bfloat162_rn(v.z, v.w);
    o[i] = make_uint2(*reinterpret_cast<uint32_t *>(&a), *reinterpret_cast<uint32_t *>(&b));
  }
}


static float timed(cudaEvent_t a, cudaEvent_t b) { float ms; cudaEventElapsedTime(&ms, a, b); return ms; }

int main() {
  CK(cuInit(0));
  CUdevice dev; CK(cuDeviceGet(&dev, 0));
  int comp = 0; CK(cuDeviceGetAttribute(&comp, CU_DEVICE_ATTRIBUTE_GENERIC_COMPRESSION_SUPPORTED, dev));
  printf("generic compression supported: %d\n", comp);
  CK(cudaFree(0));
  const size_t bytes = (size_t)1 << 30, n4 = bytes / 16, n = bytes / 4;
  CUmemAllocationProp prop = {};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = 0;
  prop.allocFlags.compressionType = CU_MEM_ALLOCATION_COMP_GENERIC;
  size_t gran = 0; CK(cuMemGetAllocationGranularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED));
  size_t sz = (bytes + gran - 1) / gran * gran;
  CUmemGenericAllocationHandle h; CK(cuMemCreate(&h, sz, &prop, 0));
  CUmemAllocationProp got = {}; CK(cuMemGetAllocationPropertiesFromHandle(&got, h));
  printf("granularity %zu, compression type granted: %d\n", gran, (int)got.allocFlags.compressionType);
  CUdeviceptr va; CK(cuMemAddressReserve(&va, sz, 0, 0, 0)); CK(cuMemMap(va, sz, 0, h, 0));
  CUmemAccessDesc acc = {}; acc.location = prop.location; acc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  CK(cuMemSetAccess(va, sz, &acc, 1));
  float *pc = (float *)va, *pr; CK(cudaMalloc(&pr, bytes));
  uint2 *o; CK(cudaMalloc(&o, bytes / 2));
  char *flush; CK(cudaMalloc(&flush, 512 << 20));
  cudaEvent_t e[6]; for (auto &x : e) cudaEventCreate(&x);
  for (int adds : {1, 5}) {
    for (int which = 0; which < 2; ++which) {
      float *p = which ? pc : pr;
      std::vector<float> tz, tm, ta, tc;
      for (int rep = 0; rep < 7; ++rep) {
        cudaMemsetAsync(flush, rep, 512 << 20);
        cudaEventRecord(e[0]);
        zero_k<<<132 * 8, 512>>>((float4 *)p, n4);
        cudaEventRecord(e[1]);
        cudaMemsetAsync(p, 0, bytes);
        cudaEventRecord(e[2]);
        add_k<<<132 * 8, 512>>>(p, n, adds);
        cudaEventRecord(e[3]);
        convert_k<<<132 * 8, 512>>>((const float4 *)p, o, n4);
        cudaEventRecord(e[4]);
        CK(cudaEventSynchronize(e[4]));
        tz.push_back(timed(e[0], e[1])); tm.push_back(timed(e[1], e[2]));
        ta.push_back(timed(e[2], e[3])); tc.push_back(timed(e[3], e[4]));
      }
      auto med = [](std::vector<float> v) { std::sort(v.begin(), v.end()); return v[v.size() / 2]; };
      printf("%s adds=%d: zero kernel %.3f ms  memset %.3f ms  add pass %.3f ms  convert %.3f ms\n",
             which ? "compressible" : "cudaMalloc  ", adds, med(tz), med(tm), med(ta), med(tc));
    }
  }
  CK(cudaGetLastError()); CK(cudaDeviceSynchronize());
  printf("done\n");
  return 0;
}
