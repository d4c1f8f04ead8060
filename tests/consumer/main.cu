// A consumer of qcoll's CUDA umbrella header: the shared host/device conversions in a kernel.
#include <qcoll/qcoll.cuh>

#include <cstdio>

__global__ void round_trip(const float* in, float* out, int n) {
  const int i = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  if (i < n) out[i] = qcoll::to_float(qcoll::from_float<qcoll::bfloat16>(in[i]));
}

int main() {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("qcoll %d: no GPU, kernel not launched\n", qcoll::version());
    return 0;
  }
  float host_in = 1.0f;
  float host_out = 0.0f;
  float* buf = nullptr;
  if (cudaMalloc(&buf, 2 * sizeof(float)) != cudaSuccess) return 1;
  cudaMemcpy(buf, &host_in, sizeof(float), cudaMemcpyHostToDevice);
  round_trip<<<1, 32>>>(buf, buf + 1, 1);
  cudaMemcpy(&host_out, buf + 1, sizeof(float), cudaMemcpyDeviceToHost);
  cudaFree(buf);
  // 1.0 is exactly representable in bfloat16.
  if (host_out != 1.0f) return 2;
  std::printf("qcoll %d: device round trip ok\n", qcoll::version());
  return 0;
}
