// What configure found (src/gpu/gpu_config.h), checked against the machine itself: the
// toolchains on disk, the symbols in their headers, and the targets inside the kernel objects
// the build produced. A detection that drifts from the machine fails here.
#include "src/gpu/gpu_config.h"

#include <fstream>
#include <sstream>
#include <string>
#include <unistd.h>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_split.h"
#include "gtest/gtest.h"

#include "src/gpu/runtime.h"

namespace kvwire::gpu {
namespace {

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}
bool Executable(const std::string& path) {
  return !path.empty() && access(path.c_str(), X_OK) == 0;
}
std::vector<std::string> List(const char* csv) {
  return absl::StrSplit(csv, ',', absl::SkipEmpty());
}

TEST(GpuConfig, DefaultBackendIsOneThatWasBuilt) {
  const std::string b = KVWIRE_GPU_DEFAULT_BACKEND;
  if (b == "cuda") {
    EXPECT_EQ(KVWIRE_GPU_BUILT_CUDA, 1);
  }
  if (b == "hip") {
    EXPECT_EQ(KVWIRE_GPU_BUILT_HIP, 1);
  }
  EXPECT_TRUE(b == "none" || b == "cuda" || b == "hip") << b;
  const std::string requested = KVWIRE_GPU_REQUESTED;
  if (requested != "auto") {
    EXPECT_EQ(b, requested);
  }
  // auto prefers cuda, then hip (see cmake/gpu.cmake).
  if (requested == "auto" && Executable(KVWIRE_GPU_NVCC)) {
    EXPECT_EQ(b, "cuda");
  }
}

TEST(GpuConfig, CudaDetectionMatchesTheMachine) {
  const std::string nvcc_at_root = std::string(KVWIRE_GPU_CUDA_ROOT) + "/bin/nvcc";
  const std::string requested = KVWIRE_GPU_REQUESTED;
  if (requested == "none") {
    EXPECT_EQ(KVWIRE_GPU_BUILT_CUDA, 0);
    return;
  }
  if (!Executable(KVWIRE_GPU_NVCC)) {
    EXPECT_FALSE(Executable(nvcc_at_root)) << nvcc_at_root << " exists but was not found";
    EXPECT_EQ(KVWIRE_GPU_BUILT_CUDA, 0);
    GTEST_SKIP() << "no nvcc on this machine: the CUDA backend is not compiled here";
  }
  const std::string include = KVWIRE_GPU_CUDA_INCLUDE;
  ASSERT_FALSE(include.empty());
  EXPECT_TRUE(access((include + "/cuda_runtime_api.h").c_str(), R_OK) == 0) << include;
  if (KVWIRE_GPU_BUILD_ALL || std::string(KVWIRE_GPU_DEFAULT_BACKEND) == "cuda") {
    EXPECT_EQ(KVWIRE_GPU_BUILT_CUDA, 1);
  }
  const bool header_has =
      absl::StrContains(ReadFile(include + "/cuda.h"), "cuMemGetHandleForAddressRange");
  EXPECT_EQ(KVWIRE_GPU_CUDA_HAS_DMABUF, header_has ? 1 : 0);
}

TEST(GpuConfig, HipDetectionMatchesTheMachine) {
  if (std::string(KVWIRE_GPU_REQUESTED) == "none") {
    EXPECT_EQ(KVWIRE_GPU_BUILT_HIP, 0);
    return;
  }
  if (!Executable(KVWIRE_GPU_HIPCC)) {
    EXPECT_EQ(KVWIRE_GPU_BUILT_HIP, 0);
    GTEST_SKIP() << "no hipcc on this machine: the HIP backend is not compiled here";
  }
  const std::string include = KVWIRE_GPU_HIP_INCLUDE;
  ASSERT_FALSE(include.empty());
  const std::string api = ReadFile(include + "/hip/hip_runtime_api.h");
  ASSERT_FALSE(api.empty()) << include;
  EXPECT_EQ(KVWIRE_GPU_HIP_HAS_HIP_DMABUF,
            absl::StrContains(api, "hipMemGetHandleForAddressRange") ? 1 : 0);
  EXPECT_EQ(
      KVWIRE_GPU_HIP_HAS_HSA_DMABUF,
      absl::StrContains(ReadFile(include + "/hsa/hsa_ext_amd.h"), "hsa_amd_portable_export_dmabuf")
          ? 1
          : 0);
}

TEST(GpuConfig, KernelObjectsHoldCodeForEveryConfiguredTarget) {
  const std::vector<std::string> cuda_objs = List(KVWIRE_GPU_CUDA_KERNEL_OBJECTS);
  const std::vector<std::string> hip_objs = List(KVWIRE_GPU_HIP_KERNEL_OBJECTS);
  EXPECT_EQ(cuda_objs.empty(), KVWIRE_GPU_BUILT_CUDA == 0);
  EXPECT_EQ(hip_objs.empty(), KVWIRE_GPU_BUILT_HIP == 0);
  if (cuda_objs.empty() && hip_objs.empty()) GTEST_SKIP() << "no GPU backend compiled here";
  for (const std::string& obj : cuda_objs) {
    const std::string bytes = ReadFile(obj);
    ASSERT_FALSE(bytes.empty()) << obj;
    for (const std::string& arch : List(KVWIRE_GPU_CUDA_ARCHS)) {
      EXPECT_TRUE(absl::StrContains(bytes, "sm_" + arch)) << obj << " lacks sm_" << arch;
    }
  }
  for (const std::string& obj : hip_objs) {
    const std::string bytes = ReadFile(obj);
    ASSERT_FALSE(bytes.empty()) << obj;
    for (const std::string& arch : List(KVWIRE_GPU_HIP_ARCHS)) {
      EXPECT_TRUE(absl::StrContains(bytes, "amdhsa--" + arch)) << obj << " lacks " << arch;
    }
  }
}

}  // namespace
}  // namespace kvwire::gpu
