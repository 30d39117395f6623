#pragma once
// Ctrl-C for long runs. While an InterruptScope is alive, SIGINT and SIGTERM only raise a flag; the
// run polls it at safe points (throw_if_interrupted, or Progress::update) and unwinds with
// Interrupted, so that no output is left half-written. A second signal while the first is pending
// ends the process at once, as the default action would (the impatient user still wins).

#include <stdexcept>

namespace qkv {

// Thrown at a poll point after SIGINT or SIGTERM arrived.
class Interrupted : public std::runtime_error {
 public:
  explicit Interrupted(int signal_number);
  int signal_number() const { return signal_number_; }

 private:
  int signal_number_;
};

class InterruptScope {
 public:
  // Installs the handlers and clears any earlier request. Scopes do not nest.
  InterruptScope();
  InterruptScope(const InterruptScope&) = delete;
  InterruptScope& operator=(const InterruptScope&) = delete;
  // Puts back the handlers that were there before.
  ~InterruptScope();
};

// Whether SIGINT or SIGTERM arrived inside the current InterruptScope.
bool interrupt_requested();

// Throws Interrupted when interrupt_requested().
void throw_if_interrupted();

// Ends the process as `signal_number` would have by default (so that a shell sees "killed by
// SIGINT" and stops a script): restores the default action and raises the signal.
[[noreturn]] void exit_by_signal(int signal_number);

}  // namespace qkv
