#include "support/interrupt.hpp"

#include <fmt/format.h>

#include <csignal>
#include <cstdlib>
#include <cstring>

namespace qkv {
namespace {

// Written by the handler, so only a lock-free atomic type: sig_atomic_t.
volatile std::sig_atomic_t pending_signal = 0;

struct sigaction previous_int;
struct sigaction previous_term;

extern "C" void on_signal(int signal_number) {
  if (pending_signal != 0) {
    // The second Ctrl-C: nothing is being written that the user still cares to wait for.
    std::signal(signal_number, SIG_DFL);
    std::raise(signal_number);
    return;
  }
  pending_signal = signal_number;
}

}  // namespace

Interrupted::Interrupted(int signal_number)
    : std::runtime_error(fmt::format("interrupted by {}", signal_number == SIGTERM ? "SIGTERM" : "SIGINT")),
      signal_number_(signal_number) {}

InterruptScope::InterruptScope() {
  pending_signal = 0;
  struct sigaction action;
  std::memset(&action, 0, sizeof action);
  action.sa_handler = on_signal;
  sigemptyset(&action.sa_mask);
  // Restart system calls: a read or write cut short by the signal carries on, the flag is seen later.
  action.sa_flags = SA_RESTART;
  sigaction(SIGINT, &action, &previous_int);
  sigaction(SIGTERM, &action, &previous_term);
}

InterruptScope::~InterruptScope() {
  sigaction(SIGINT, &previous_int, nullptr);
  sigaction(SIGTERM, &previous_term, nullptr);
}

bool interrupt_requested() { return pending_signal != 0; }

void throw_if_interrupted() {
  if (pending_signal != 0) throw Interrupted(pending_signal);
}

void exit_by_signal(int signal_number) {
  std::signal(signal_number, SIG_DFL);
  std::raise(signal_number);
  // Only reached if the signal is blocked: exit with the status a shell reports for it.
  std::_Exit(128 + signal_number);
}

}  // namespace qkv
