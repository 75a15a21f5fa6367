// A minimal module tree: named parameters and children, a training flag. Parameter names are the Hugging Face
// state-dict keys ("decoder.block.0.layer.1.EncDecAttention.q.weight"), so loading and saving need no mapping.
// (torch::nn::Module would do the same at the cost of its serialisation headers in every model file.)
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

namespace trainer {

class Module {
 public:
  virtual ~Module() = default;
  Module() = default;
  Module(const Module&) = delete;
  Module& operator=(const Module&) = delete;

  // Every parameter with its full dotted name. The slot is the member the layer computes with, so assigning to
  // it (dtype conversion, loading, LoRA freezing) changes what the layer uses.
  void for_each_parameter(const std::function<void(const std::string&, at::Tensor&)>& visit,
                          const std::string& prefix = "");
  std::vector<std::pair<std::string, at::Tensor>> named_parameters();
  // Every module below this one with its full dotted name ("model.layers.0.self_attn.q_proj"), parents first:
  // how wrappers applied from outside (LoRA) find the layers they adapt.
  void for_each_module(const std::function<void(const std::string&, Module&)>& visit, const std::string& prefix = "");

  // Dropout and other training-only behaviour.
  void train(bool on = true);
  bool is_training() const { return training_; }

 protected:
  void register_parameter(std::string name, at::Tensor* slot) { parameters_.emplace_back(std::move(name), slot); }
  // Removes the parameters whose names start with `prefix` (a layer changing its representation: 4-bit weights).
  void unregister_parameters(const std::string& prefix);
  // `first`: visited before the other children (a parameter that was the module's own keeps its place in the order).
  template <class M>
  std::shared_ptr<M> register_module(std::string name, std::shared_ptr<M> child, bool first = false) {
    children_.emplace(first ? children_.begin() : children_.end(), std::move(name), child);
    return child;
  }

 private:
  std::vector<std::pair<std::string, at::Tensor*>> parameters_;
  std::vector<std::pair<std::string, std::shared_ptr<Module>>> children_;
  bool training_ = true;
};

}  // namespace trainer
