// The notification webhook (users post to a Discord channel): JSON bodies POSTed from a background thread, so a
// slow, failing or unreachable endpoint never stops or stalls training. The URL comes from the environment
// (TRAINER_WEBHOOK_URL) and is never logged: it usually carries a secret token.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <mutex>
#include <string>
#include <thread>

#include <nlohmann/json_fwd.hpp>

namespace trainer {

inline constexpr const char* kWebhookEnvironmentVariable = "TRAINER_WEBHOOK_URL";

struct WebhookOptions {
  std::chrono::milliseconds timeout{5000};        // per request, connecting included
  std::chrono::milliseconds drain_timeout{5000};  // what the destructor gives unsent messages, in total
  std::size_t queue_capacity = 32;                // when full, the oldest queued message is dropped
  int max_warnings = 3;                           // failures logged; later ones only counted
};

class Webhook {
 public:
  // `url` must start with http:// or https:// (UsageError otherwise, without the URL in the message).
  explicit Webhook(std::string url, WebhookOptions options = {});
  // Sends what is still queued within drain_timeout, then stops.
  ~Webhook();
  Webhook(const Webhook&) = delete;
  Webhook& operator=(const Webhook&) = delete;

  // Queues one POST; returns at once.
  void post(const nlohmann::json& body);

  int64_t sent() const;     // answered with HTTP 2xx
  int64_t failed() const;   // errors, timeouts, other statuses
  int64_t dropped() const;  // pushed out of a full queue, or left when the drain time ran out

 private:
  void run();
  void send(const std::string& body, std::chrono::milliseconds timeout);
  void warn(const std::string& what);

  std::string url_;
  WebhookOptions options_;
  mutable std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<std::string> queue_;
  bool stopping_ = false;
  std::chrono::steady_clock::time_point drain_deadline_;
  int64_t sent_ = 0, failed_ = 0, dropped_ = 0;
  int warnings_ = 0;
  std::thread thread_;  // last: started once everything above exists
};

// The webhook URL from TRAINER_WEBHOOK_URL, or empty.
std::string webhook_url_from_environment();

}  // namespace trainer
