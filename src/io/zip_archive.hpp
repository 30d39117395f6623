#pragma once
// The members of a ZIP archive held in memory, as np.savez writes them: stored (not compressed),
// with or without ZIP64 fields. Enough of the format (PKWARE APPNOTE 6.3) to find and slice each
// member; a compressed or encrypted member is listed but refused when read.

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace qkv::io_detail {

struct ZipMember {
  std::string name;
  uint16_t method = 0;  // 0 stored, 8 deflated, ...
  bool encrypted = false;
  uint64_t size = 0;           // uncompressed
  uint64_t stored_size = 0;    // as stored in the archive
  uint64_t header_offset = 0;  // of the member's local header
};

// The members listed in the central directory of `archive`. Throws std::invalid_argument saying
// what is malformed.
std::vector<ZipMember> zip_members(std::string_view archive);

// The bytes of a stored member (a view into `archive`). Throws std::invalid_argument for a
// compressed or encrypted member, or a malformed local header.
std::string_view zip_member_bytes(std::string_view archive, const ZipMember& member);

}  // namespace qkv::io_detail
