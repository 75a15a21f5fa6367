// A stand-in for the Gloo headers that torch's ProcessGroupGloo.hpp includes: the pip wheel ships that header but
// not <gloo/...>, while libtorch_cpu exports the Gloo backend itself. Only what the declarations in
// ProcessGroupGloo.hpp name is declared here; trainer never touches a gloo object (see docs/distributed.md).
// Never link a separate libgloo beside libtorch: its exported symbols would interpose torch's own copy.
#pragma once

#include <chrono>
#include <string>
#include <vector>

namespace gloo {

class Context {
 public:
  virtual ~Context() = default;
  void setTimeout(std::chrono::milliseconds timeout);
};

namespace rendezvous {
class Store {
 public:
  virtual ~Store() = default;
  virtual void set(const std::string& key, const std::vector<char>& data) = 0;
  virtual std::vector<char> get(const std::string& key) = 0;
  virtual void wait(const std::vector<std::string>& keys) = 0;
  virtual void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) = 0;
};
}  // namespace rendezvous

namespace transport {
class Device;
class UnboundBuffer;
}  // namespace transport

}  // namespace gloo
