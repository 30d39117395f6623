#pragma once
// Errors that qkv raises. Every message names the argument at fault, what was expected and what
// came, so a caller (or the CLI) can show it as one line.

#include <stdexcept>
#include <string>

namespace qkv {

// Base of every error qkv throws on bad input; the CLI maps it to exit code 2.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A shape, stride or dtype that does not fit what an op needs.
class ShapeError : public Error {
 public:
  using Error::Error;
};

// Input values an op refuses (non-finite numbers, out-of-range options).
class ValueError : public Error {
 public:
  using Error::Error;
};

// A file that cannot be read or written, or whose contents are malformed.
class IoError : public Error {
 public:
  using Error::Error;
};

// A request whose memory would exceed what the machine can give, refused before allocating.
class ResourceError : public Error {
 public:
  using Error::Error;
};

}  // namespace qkv
