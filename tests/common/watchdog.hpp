// Aborts the process if a test runs longer than a limit: a hang in a collective must fail loudly
// instead of stalling the test run.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <thread>

namespace testing_support {

class Watchdog {
 public:
  //! Starts counting; the destructor stops it. `what` names the test in the abort message.
  explicit Watchdog(int seconds, const char* what = "test")
      : thread_([this, seconds, what] {
          std::unique_lock<std::mutex> lk(mu_);
          if (!cv_.wait_for(lk, std::chrono::seconds(seconds), [this] { return done_; })) {
            std::fprintf(stderr, "%s: watchdog fired after %d s (a collective hangs)\n", what, seconds);
            std::abort();
          }
        }) {}
  ~Watchdog() {
    {
      std::lock_guard<std::mutex> lk(mu_);
      done_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  std::thread thread_;
};

}  // namespace testing_support
