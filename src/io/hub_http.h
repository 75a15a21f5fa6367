// The HTTP side of the Hub client (hub.cpp): one libcurl request at a time, redirects followed by hand so the token
// stays on the endpoint's host, bodies into memory or appended to a download's .incomplete file.
#pragma once

#include <cstdint>
#include <chrono>
#include <cstdio>
#include <map>
#include <string>

#include "trainer/errors.h"
#include "trainer/hub.h"

namespace trainer::hub {

// A request that never reached an HTTP answer (no route, refused, timed out, cut): the caller may retry it or, for
// metadata, fall back to the cache.
class NetworkError : public DataError {
 public:
  NetworkError(std::string message, bool transient) : DataError(std::move(message)), transient_(transient) {}
  bool transient() const { return transient_; }

 private:
  bool transient_;
};

struct Response {
  long status = 0;
  std::map<std::string, std::string> headers;  // lower-case names, the last value of each
  std::string body;
  std::string url;  // the URL that answered
};

// Sink of a download: the .incomplete file. Only 200/206 bodies go to it; a write error is kept to report.
struct FileSink {
  std::FILE* file = nullptr;
  int write_errno = 0;
  std::uint64_t written = 0;
  long status = 0;        // of the response being received
  void* curl = nullptr;   // the transfer's handle, to read that status
};

// What a download shows on a terminal while it grows: bytes, rate, ETA.
struct Progress {
  std::string name;
  std::uint64_t total = 0, start_offset = 0;
  std::chrono::steady_clock::time_point started = std::chrono::steady_clock::now(), last_shown{};
  bool terminal = false;
};

class Http {
 public:
  explicit Http(const HubSettings& settings);

  // One request, no redirect followed. `range_from` > 0 adds a Range header; `sink` receives the body of a GET
  // into a file (else it is collected into the response, or nothing for HEAD). Throws NetworkError when no answer
  // came, DataError when the sink could not be written.
  Response once(const std::string& method, const std::string& url, std::uint64_t range_from = 0,
                FileSink* sink = nullptr, Progress* progress = nullptr) const;

  // A request with redirects followed (at most 10; the token is left behind when one leaves the endpoint's host).
  // A HEAD stops at an absolute redirect and answers with its headers: the Hub's LFS files carry X-Linked-Etag
  // and X-Linked-Size on that 302.
  Response follow(const std::string& method, std::string url, std::uint64_t range_from = 0, FileSink* sink = nullptr,
                  Progress* progress = nullptr) const;

 private:
  const HubSettings& settings_;
  std::string endpoint_origin_;
};

// scheme://host:port of a URL; `location` (absolute or relative) joined to `base`; a URL without its query (signed
// CDN URLs carry credentials there), for messages; one path part, or a path with its slashes kept, %-escaped.
std::string origin_of(const std::string& url);
std::string join_url(const std::string& base, const std::string& location);
std::string printable_url(const std::string& url);
std::string escape_path_part(const std::string& part);
std::string escape_path(const std::string& path);

// 429 and 5xx: worth another attempt.
bool retriable_status(long status);
// The back-off before attempt `attempt` (1-based): base, 2 base, 4 base ..., at most 30 s, with some jitter.
void back_off(const HubSettings& settings, int attempt);

// Without the surrounding white space.
std::string trimmed(std::string s);

}  // namespace trainer::hub
