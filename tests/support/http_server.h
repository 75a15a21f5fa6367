// A tiny HTTP/1.1 server on 127.0.0.1 (an ephemeral port) for webhook tests: it records every request (method,
// path, headers, body) and answers with a fixed status, optionally after a delay, one connection at a time.
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cctype>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace trainer::test {

struct HttpRequest {
  std::string method;
  std::string path;
  std::string headers;  // as received, lower-cased
  std::string body;
};

class HttpServer {
 public:
  explicit HttpServer(int status = 200, std::chrono::milliseconds delay = std::chrono::milliseconds(0))
      : status_(status), delay_(delay) {
    listener_ = ::socket(AF_INET, SOCK_STREAM, 0);
    const int one = 1;
    ::setsockopt(listener_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    address.sin_port = 0;  // the kernel picks a free port
    if (::bind(listener_, reinterpret_cast<sockaddr*>(&address), sizeof address) != 0 || ::listen(listener_, 16) != 0)
      throw std::runtime_error("test HTTP server: cannot listen on 127.0.0.1");
    socklen_t length = sizeof address;
    ::getsockname(listener_, reinterpret_cast<sockaddr*>(&address), &length);
    port_ = ntohs(address.sin_port);
    thread_ = std::thread([this] { serve(); });
  }

  ~HttpServer() {
    {
      std::lock_guard lock(mutex_);
      stop_ = true;
    }
    changed_.notify_all();
    thread_.join();
    ::close(listener_);
  }

  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  int port() const { return port_; }
  std::string url(const std::string& path = "/hook") const {
    return "http://127.0.0.1:" + std::to_string(port_) + path;
  }

  // Waits until `count` requests have arrived (true) or `timeout` has passed (false).
  bool wait_for(std::size_t count, std::chrono::milliseconds timeout) {
    std::unique_lock lock(mutex_);
    return changed_.wait_for(lock, timeout, [&] { return requests_.size() >= count; });
  }

  std::vector<HttpRequest> requests() const {
    std::lock_guard lock(mutex_);
    return requests_;
  }

 private:
  void serve() {
    for (;;) {
      {
        std::lock_guard lock(mutex_);
        if (stop_) return;
      }
      pollfd waiting{listener_, POLLIN, 0};
      if (::poll(&waiting, 1, 50) <= 0) continue;
      const int client = ::accept(listener_, nullptr, nullptr);
      if (client < 0) continue;
      handle(client);
      ::close(client);
    }
  }

  void handle(int client) {
    timeval receive_timeout{2, 0};
    ::setsockopt(client, SOL_SOCKET, SO_RCVTIMEO, &receive_timeout, sizeof receive_timeout);
    std::string data;
    std::size_t header_end = std::string::npos, content_length = 0;
    char buffer[4096];
    for (;;) {
      if (header_end != std::string::npos && data.size() >= header_end + 4 + content_length) break;
      const auto n = ::recv(client, buffer, sizeof buffer, 0);
      if (n <= 0) return;
      data.append(buffer, static_cast<std::size_t>(n));
      if (header_end == std::string::npos && (header_end = data.find("\r\n\r\n")) != std::string::npos) {
        std::string head = data.substr(0, header_end);
        for (auto& c : head) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
        if (const auto at = head.find("content-length:"); at != std::string::npos)
          content_length = std::stoul(head.substr(at + 15));
      }
    }
    HttpRequest request;
    const auto first_space = data.find(' ');
    request.method = data.substr(0, first_space);
    request.path = data.substr(first_space + 1, data.find(' ', first_space + 1) - first_space - 1);
    request.headers = data.substr(0, header_end);
    for (auto& c : request.headers) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    request.body = data.substr(header_end + 4, content_length);
    {
      std::unique_lock lock(mutex_);
      requests_.push_back(request);
      changed_.notify_all();
      // A slow endpoint: answer late (or never, when stopped first).
      if (changed_.wait_for(lock, delay_, [this] { return stop_; })) return;
    }
    const std::string response = "HTTP/1.1 " + std::to_string(status_) +
                                 " Test\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok";
    ::send(client, response.data(), response.size(), MSG_NOSIGNAL);
  }

  int status_;
  std::chrono::milliseconds delay_;
  int listener_ = -1;
  int port_ = 0;
  mutable std::mutex mutex_;
  std::condition_variable changed_;
  std::vector<HttpRequest> requests_;
  bool stop_ = false;
  std::thread thread_;
};

// A local port where nothing listens (bound, then closed): connecting is refused at once.
inline int closed_port() {
  const int s = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ::bind(s, reinterpret_cast<sockaddr*>(&address), sizeof address);
  socklen_t length = sizeof address;
  ::getsockname(s, reinterpret_cast<sockaddr*>(&address), &length);
  ::close(s);
  return ntohs(address.sin_port);
}

}  // namespace trainer::test
