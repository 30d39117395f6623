#pragma once
// Stopping a long call from outside it: Ctrl-C in Python, where the interpreter can raise
// KeyboardInterrupt only once the call has returned. While a CancelScope is alive on a thread,
// every parallel_for that this thread starts asks the scope's `requested` function before each
// task; once it answers true, the tasks not yet begun are skipped and parallel_for throws
// Cancelled. A cancelled op leaves its outputs partly written: the caller discards them.

#include <stdexcept>

namespace qkv {

// Thrown by parallel_for when the CancelScope of the calling thread asked it to stop.
class Cancelled : public std::runtime_error {
 public:
  Cancelled();
};

class CancelScope {
 public:
  // `requested` is called from any of the pool's threads, often: it must be cheap and thread-safe
  // (read an atomic flag). Scopes nest; the innermost one is asked.
  explicit CancelScope(bool (*requested)());
  CancelScope(const CancelScope&) = delete;
  CancelScope& operator=(const CancelScope&) = delete;
  ~CancelScope();

 private:
  bool (*previous_)();
};

}  // namespace qkv
