// Copies whole blocks of the paged KV cache in every layer in one call: a request's draft branches
// fork the block holding its newest token, and a winning branch's blocks are copied back. A step
// touches some sixty caches for a few kilobytes each, so per-cache operator calls would cost far
// more than the copies.

#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <vector>

namespace {

void copy_kv_blocks_(const std::vector<at::Tensor>& caches, const std::vector<int64_t>& sources,
                     const std::vector<int64_t>& targets) {
  TORCH_CHECK(sources.size() == targets.size(), "copy_kv_blocks_: ", sources.size(), " sources for ",
              targets.size(), " targets");
  for (const at::Tensor& cache : caches) {
    if (cache.numel() == 0) continue;  // MLA's value caches are empty
    TORCH_CHECK(cache.is_contiguous() && cache.device().is_cpu(), "copy_kv_blocks_: caches must be contiguous CPU tensors");
    const int64_t num_blocks = cache.size(0);
    const int64_t block_bytes = cache.stride(0) * static_cast<int64_t>(cache.element_size());
    char* base = static_cast<char*>(cache.data_ptr());
    for (size_t i = 0; i < sources.size(); ++i) {
      TORCH_CHECK(sources[i] >= 0 && sources[i] < num_blocks && targets[i] >= 0 && targets[i] < num_blocks,
                  "copy_kv_blocks_: block index out of range");
      if (sources[i] != targets[i]) {
        std::memcpy(base + targets[i] * block_bytes, base + sources[i] * block_bytes, block_bytes);
      }
    }
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(sonar, m) {
  m.def("copy_kv_blocks_(Tensor(a!)[] caches, int[] sources, int[] targets) -> ()");
}

TORCH_LIBRARY_IMPL(sonar, CPU, m) { m.impl("copy_kv_blocks_", &copy_kv_blocks_); }
