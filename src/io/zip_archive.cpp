#include "zip_archive.hpp"

#include <fmt/format.h>

#include <stdexcept>

namespace qkv::io_detail {
namespace {

constexpr uint32_t kEndOfDirectory = 0x06054b50;
constexpr uint32_t kZip64EndOfDirectory = 0x06064b50;
constexpr uint32_t kZip64Locator = 0x07064b50;
constexpr uint32_t kDirectoryEntry = 0x02014b50;
constexpr uint32_t kLocalHeader = 0x04034b50;
constexpr size_t kEndOfDirectorySize = 22;
constexpr size_t kZip64LocatorSize = 20;
constexpr uint16_t kZip64Extra = 0x0001;
constexpr uint32_t kMore32 = 0xffffffff;  // "see the ZIP64 field"

[[noreturn]] void malformed(std::string_view what) { throw std::invalid_argument(std::string(what)); }

// Little-endian integers at `offset`, refusing reads past the end.
uint64_t read_le(std::string_view bytes, uint64_t offset, int width) {
  if (offset > bytes.size() || bytes.size() - offset < static_cast<uint64_t>(width)) {
    malformed(fmt::format("a field at byte {} runs past the end of the archive ({} bytes)", offset, bytes.size()));
  }
  uint64_t value = 0;
  for (int i = width; i-- > 0;)
    value = (value << 8) | static_cast<unsigned char>(bytes[offset + static_cast<uint64_t>(i)]);
  return value;
}
uint16_t u16(std::string_view b, uint64_t at) { return static_cast<uint16_t>(read_le(b, at, 2)); }
uint32_t u32(std::string_view b, uint64_t at) { return static_cast<uint32_t>(read_le(b, at, 4)); }
uint64_t u64(std::string_view b, uint64_t at) { return read_le(b, at, 8); }

// Where the end-of-central-directory record starts: the last signature within the comment's reach.
uint64_t end_of_directory(std::string_view archive) {
  if (archive.size() < kEndOfDirectorySize) malformed("too short for a ZIP archive (no end of central directory)");
  const uint64_t last = archive.size() - kEndOfDirectorySize;
  const uint64_t first = last > 0xffff ? last - 0xffff : 0;
  for (uint64_t at = last + 1; at-- > first;) {
    if (u32(archive, at) == kEndOfDirectory) return at;
  }
  malformed("no end-of-central-directory record: not a ZIP archive");
}

}  // namespace

std::vector<ZipMember> zip_members(std::string_view archive) {
  const uint64_t end = end_of_directory(archive);
  uint64_t count = u16(archive, end + 10);
  uint64_t directory = u32(archive, end + 16);
  if (count == 0xffff || directory == kMore32) {
    if (end < kZip64LocatorSize || u32(archive, end - kZip64LocatorSize) != kZip64Locator) {
      malformed("ZIP64 fields without a ZIP64 end-of-central-directory locator");
    }
    const uint64_t record = u64(archive, end - kZip64LocatorSize + 8);
    if (u32(archive, record) != kZip64EndOfDirectory) malformed("the ZIP64 end-of-central-directory record is missing");
    count = u64(archive, record + 32);
    directory = u64(archive, record + 48);
  }
  std::vector<ZipMember> members;
  uint64_t at = directory;
  for (uint64_t i = 0; i < count; ++i) {
    if (u32(archive, at) != kDirectoryEntry) malformed(fmt::format("central directory entry {} is malformed", i));
    ZipMember m;
    m.encrypted = (u16(archive, at + 8) & 1) != 0;
    m.method = u16(archive, at + 10);
    m.stored_size = u32(archive, at + 20);
    m.size = u32(archive, at + 24);
    const uint16_t name_length = u16(archive, at + 28), extra_length = u16(archive, at + 30);
    const uint16_t comment_length = u16(archive, at + 32);
    m.header_offset = u32(archive, at + 42);
    if (archive.size() - at < 46u + name_length + extra_length + comment_length) {
      malformed(fmt::format("central directory entry {} runs past the end of the archive", i));
    }
    m.name = std::string(archive.substr(at + 46, name_length));
    // The ZIP64 extra field holds, in this order, those of the three that did not fit in 32 bits.
    const uint64_t extra_end = at + 46 + name_length + extra_length;
    for (uint64_t e = at + 46 + name_length; e + 4 <= extra_end;) {
      const uint16_t id = u16(archive, e), length = u16(archive, e + 2);
      if (id == kZip64Extra) {
        uint64_t field = e + 4;
        for (uint64_t* value : {&m.size, &m.stored_size, &m.header_offset}) {
          if (*value == kMore32 && field + 8 <= e + 4 + length) {
            *value = u64(archive, field);
            field += 8;
          }
        }
      }
      e += 4 + uint64_t{length};
    }
    members.push_back(std::move(m));
    at = extra_end + comment_length;
  }
  return members;
}

std::string_view zip_member_bytes(std::string_view archive, const ZipMember& member) {
  if (member.encrypted) malformed(fmt::format("member {} is encrypted", member.name));
  if (member.method != 0) {
    malformed(
        fmt::format("member {} is compressed (method {}; np.savez_compressed writes such archives), and qkv "
                    "reads only stored members: save with np.savez",
                    member.name, member.method));
  }
  const uint64_t at = member.header_offset;
  if (u32(archive, at) != kLocalHeader) malformed(fmt::format("the local header of member {} is missing", member.name));
  const uint64_t data = at + 30 + u16(archive, at + 26) + u16(archive, at + 28);
  if (data > archive.size() || archive.size() - data < member.stored_size) {
    malformed(fmt::format("member {} runs past the end of the archive", member.name));
  }
  return archive.substr(data, member.stored_size);
}

}  // namespace qkv::io_detail
