#include "tests/unit/level_zero/opencl_kernel_queue.h"

#define CL_TARGET_OPENCL_VERSION 120
#include <CL/cl.h>

#include <string>
#include <utility>

#include "absl/strings/str_cat.h"

namespace muond::server::device::level_zero {
namespace {

absl::Status ClError(const char* call, cl_int err) {
  return absl::InternalError(absl::StrCat(call, " failed: OpenCL error ", err));
}

#define CL_RETURN_IF_ERROR(fn, ...)                                      \
  do {                                                                   \
    const cl_int muond_cl_err_ = fn(__VA_ARGS__);                        \
    if (muond_cl_err_ != CL_SUCCESS) return ClError(#fn, muond_cl_err_); \
  } while (0)

std::string PlatformString(cl_platform_id p, cl_platform_info what) {
  size_t size = 0;
  if (clGetPlatformInfo(p, what, 0, nullptr, &size) != CL_SUCCESS || size == 0) return "?";
  std::string s(size, '\0');
  clGetPlatformInfo(p, what, size, s.data(), nullptr);
  while (!s.empty() && s.back() == '\0') s.pop_back();
  return s;
}

std::string DeviceString(cl_device_id d, cl_device_info what) {
  size_t size = 0;
  if (clGetDeviceInfo(d, what, 0, nullptr, &size) != CL_SUCCESS || size == 0) return "?";
  std::string s(size, '\0');
  clGetDeviceInfo(d, what, size, s.data(), nullptr);
  while (!s.empty() && s.back() == '\0') s.pop_back();
  return s;
}

class ClBuffer final : public QueueBuffer {
 public:
  explicit ClBuffer(cl_mem mem) : mem_(mem) {}
  // OpenCL defers the release until the commands that use the buffer have finished.
  ~ClBuffer() override { clReleaseMemObject(mem_); }
  KernelBufferRef ref() const override { return {mem_}; }

 private:
  cl_mem mem_;
};

}  // namespace

struct OpenClKernelQueue::Impl {
  cl_context context = nullptr;
  cl_command_queue queue = nullptr;
  cl_program program = nullptr;
  std::map<std::string, cl_kernel> kernels;

  ~Impl() {
    for (auto& [name, k] : kernels) clReleaseKernel(k);
    if (program != nullptr) clReleaseProgram(program);
    if (queue != nullptr) clReleaseCommandQueue(queue);
    if (context != nullptr) clReleaseContext(context);
  }
};

OpenClKernelQueue::OpenClKernelQueue(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

OpenClKernelQueue::~OpenClKernelQueue() {
  if (impl_->queue != nullptr) clFinish(impl_->queue);
}

absl::StatusOr<std::unique_ptr<OpenClKernelQueue>> OpenClKernelQueue::Create(
    const std::string& source) {
  cl_uint platforms = 0;
  const cl_int got = clGetPlatformIDs(0, nullptr, &platforms);
  if (got != CL_SUCCESS || platforms == 0) {
    return absl::UnavailableError(absl::StrCat("no OpenCL platform (clGetPlatformIDs: ", got,
                                               "; install pocl-opencl-icd for the CPU platform)"));
  }
  std::vector<cl_platform_id> ids(platforms);
  CL_RETURN_IF_ERROR(clGetPlatformIDs, platforms, ids.data(), nullptr);
  cl_platform_id platform = nullptr;
  cl_device_id device = nullptr;
  for (cl_platform_id p : ids) {
    cl_uint n = 0;
    if (clGetDeviceIDs(p, CL_DEVICE_TYPE_ALL, 1, &device, &n) == CL_SUCCESS && n > 0) {
      platform = p;
      break;
    }
  }
  if (platform == nullptr) {
    return absl::UnavailableError(
        absl::StrCat(platforms, " OpenCL platform(s), none with a device"));
  }
  auto impl = std::make_unique<Impl>();
  cl_int err = CL_SUCCESS;
  impl->context = clCreateContext(nullptr, 1, &device, nullptr, nullptr, &err);
  if (err != CL_SUCCESS) return ClError("clCreateContext", err);
  impl->queue = clCreateCommandQueue(impl->context, device, 0, &err);
  if (err != CL_SUCCESS) return ClError("clCreateCommandQueue", err);
  const char* text = source.c_str();
  const size_t length = source.size();
  impl->program = clCreateProgramWithSource(impl->context, 1, &text, &length, &err);
  if (err != CL_SUCCESS) return ClError("clCreateProgramWithSource", err);
  err = clBuildProgram(impl->program, 1, &device, "", nullptr, nullptr);
  if (err != CL_SUCCESS) {
    size_t size = 0;
    clGetProgramBuildInfo(impl->program, device, CL_PROGRAM_BUILD_LOG, 0, nullptr, &size);
    std::string log(size, '\0');
    clGetProgramBuildInfo(impl->program, device, CL_PROGRAM_BUILD_LOG, size, log.data(), nullptr);
    return absl::InternalError(absl::StrCat("clBuildProgram failed (", err, "): ", log));
  }
  std::unique_ptr<OpenClKernelQueue> q(new OpenClKernelQueue(std::move(impl)));
  q->description_ = absl::StrCat(PlatformString(platform, CL_PLATFORM_NAME), " ",
                                 PlatformString(platform, CL_PLATFORM_VERSION), " / ",
                                 DeviceString(device, CL_DEVICE_NAME));
  return q;
}

absl::StatusOr<std::unique_ptr<QueueBuffer>> OpenClKernelQueue::Allocate(size_t bytes) {
  cl_int err = CL_SUCCESS;
  cl_mem mem =
      clCreateBuffer(impl_->context, CL_MEM_READ_WRITE, bytes == 0 ? 1 : bytes, nullptr, &err);
  if (err == CL_MEM_OBJECT_ALLOCATION_FAILURE || err == CL_OUT_OF_HOST_MEMORY) {
    return absl::ResourceExhaustedError(absl::StrCat("clCreateBuffer(", bytes, ") failed"));
  }
  if (err != CL_SUCCESS) return ClError("clCreateBuffer", err);
  return std::unique_ptr<QueueBuffer>(new ClBuffer(mem));
}

absl::Status OpenClKernelQueue::Launch(const char* name, const std::vector<KernelArg>& args,
                                       LaunchSize global, LaunchSize local) {
  cl_kernel& kernel = impl_->kernels[name];
  if (kernel == nullptr) {
    cl_int err = CL_SUCCESS;
    kernel = clCreateKernel(impl_->program, name, &err);
    if (err != CL_SUCCESS) {
      impl_->kernels.erase(name);
      if (err == CL_INVALID_KERNEL_NAME) return absl::NotFoundError(absl::StrCat("kernel ", name));
      return ClError("clCreateKernel", err);
    }
  }
  for (size_t i = 0; i < args.size(); ++i) {
    const KernelArg& a = args[i];
    const auto index = static_cast<cl_uint>(i);
    switch (a.kind) {
      case KernelArg::Kind::kBuffer: {
        cl_mem mem = static_cast<cl_mem>(a.buffer);
        CL_RETURN_IF_ERROR(clSetKernelArg, kernel, index, sizeof(cl_mem), &mem);
        break;
      }
      case KernelArg::Kind::kInt:
        CL_RETURN_IF_ERROR(clSetKernelArg, kernel, index, sizeof(cl_int), &a.i32);
        break;
      case KernelArg::Kind::kLong:
        CL_RETURN_IF_ERROR(clSetKernelArg, kernel, index, sizeof(cl_long), &a.i64);
        break;
      case KernelArg::Kind::kFloat:
        CL_RETURN_IF_ERROR(clSetKernelArg, kernel, index, sizeof(cl_float), &a.f32);
        break;
    }
  }
  const size_t g[3] = {global.x, global.y, global.z};
  const size_t l[3] = {local.x, local.y, local.z};
  CL_RETURN_IF_ERROR(clEnqueueNDRangeKernel, impl_->queue, kernel, 3, nullptr, g, l, 0, nullptr,
                     nullptr);
  return absl::OkStatus();
}

absl::Status OpenClKernelQueue::Read(KernelBufferRef src, size_t offset, void* dst, size_t bytes) {
  CL_RETURN_IF_ERROR(clEnqueueReadBuffer, impl_->queue, static_cast<cl_mem>(src.handle), CL_TRUE,
                     offset, bytes, dst, 0, nullptr, nullptr);
  return absl::OkStatus();
}

absl::Status OpenClKernelQueue::Write(KernelBufferRef dst, size_t offset, const void* src,
                                      size_t bytes) {
  CL_RETURN_IF_ERROR(clEnqueueWriteBuffer, impl_->queue, static_cast<cl_mem>(dst.handle), CL_TRUE,
                     offset, bytes, src, 0, nullptr, nullptr);
  return absl::OkStatus();
}

}  // namespace muond::server::device::level_zero
