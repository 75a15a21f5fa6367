// The module tree behind every model.
#include "models/module.h"

namespace trainer {

void Module::for_each_parameter(const std::function<void(const std::string&, at::Tensor&)>& visit,
                                const std::string& prefix) {
  for (auto& [name, slot] : parameters_) visit(prefix + name, *slot);
  for (auto& [name, child] : children_) child->for_each_parameter(visit, prefix + name + ".");
}

void Module::unregister_parameters(const std::string& prefix) {
  std::erase_if(parameters_, [&](const auto& entry) { return entry.first.starts_with(prefix); });
}

std::vector<std::pair<std::string, at::Tensor>> Module::named_parameters() {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for_each_parameter([&](const std::string& name, at::Tensor& t) { out.emplace_back(name, t); });
  return out;
}

void Module::for_each_module(const std::function<void(const std::string&, Module&)>& visit, const std::string& prefix) {
  for (auto& [name, child] : children_) {
    visit(prefix + name, *child);
    child->for_each_module(visit, prefix + name + ".");
  }
}

void Module::train(bool on) {
  training_ = on;
  for (auto& [name, child] : children_) child->train(on);
}

}  // namespace trainer
