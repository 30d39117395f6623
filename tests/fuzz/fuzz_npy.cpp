// libFuzzer target: the .npy reader on arbitrary bytes. Refusals (qkv::Error) are the expected
// outcome of most inputs; anything else (a crash, a sanitizer report, another exception, a hang or
// an allocation far beyond the input's size) is a bug.

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "qkv/core/error.hpp"
#include "qkv/io/npy.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    qkv::decode_npy(std::string_view(reinterpret_cast<const char*>(data), size), "fuzz.npy");
  } catch (const qkv::Error&) {
  }
  return 0;
}
