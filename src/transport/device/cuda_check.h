// CUDA runtime calls through one macro: a failure becomes a SystemError Status naming the call,
// CUDA's error text and file:line. Never exits, never aborts.
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "common/status.h"

namespace odc::cuda {

inline Status cuda_status(cudaError_t error, const char* call, const char* file, int line) {
  return Status::SystemError(std::string(call) + " failed: " + cudaGetErrorString(error) + " (" +
                             file + ":" + std::to_string(line) + ")");
}

// Makes `device` current for the scope and restores the caller's device afterwards, so library
// calls never change which GPU the calling thread works on.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    if (cudaGetDevice(&previous_) != cudaSuccess) previous_ = -1;
    if (previous_ != device) cudaSetDevice(device);
  }
  ~DeviceGuard() {
    if (previous_ >= 0) cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = -1;
};

}  // namespace odc::cuda

#define ODC_CUDA_CHECK(call)                                                       \
  do {                                                                             \
    const cudaError_t odc_cuda_error_ = (call);                                    \
    if (odc_cuda_error_ != cudaSuccess) {                                          \
      return ::odc::cuda::cuda_status(odc_cuda_error_, #call, __FILE__, __LINE__); \
    }                                                                              \
  } while (0)
