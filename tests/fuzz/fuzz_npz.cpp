// libFuzzer target: the .npz reader (ZIP central directory, ZIP64 fields, local headers, then the
// member's .npy) on arbitrary bytes, asking for its only array and for a named one.

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "qkv/core/error.hpp"
#include "qkv/io/npy.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view bytes(reinterpret_cast<const char*>(data), size);
  for (const char* member : {"", "q"}) {
    try {
      qkv::decode_npz(bytes, "fuzz.npz", member);
    } catch (const qkv::Error&) {
    }
  }
  return 0;
}
