#pragma once
// Internal to the io layer: a POSIX file descriptor closed on every path out of a scope, and the
// operating system's words for an errno.

#include <unistd.h>

#include <cerrno>
#include <string>
#include <system_error>
#include <utility>

namespace qkv::io_detail {

class Fd {
 public:
  explicit Fd(int fd) : fd_(fd) {}
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() { close(); }
  int get() const { return fd_; }
  // Closes now so that a failing close (a delayed write error) is seen; returns errno or 0.
  int close() {
    if (fd_ < 0) return 0;
    const int rc = ::close(std::exchange(fd_, -1));
    return rc == 0 ? 0 : errno;
  }

 private:
  int fd_;
};

inline std::string os_reason(int err) { return std::system_category().message(err); }

}  // namespace qkv::io_detail
