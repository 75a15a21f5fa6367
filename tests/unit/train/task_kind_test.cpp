// The registry of task kinds (train/engine/task_kind.h): each shipped config is trained by the kind its objective and
// model say, every kind answers each question the CLI and the engine ask it, and the kinds' names are what
// train_state.json's "task" holds.
#include <set>
#include <string>

#include <c10/core/Device.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "support/paths.h"
#include "train/engine/task_kind.h"
#include "trainer/config.h"
#include "trainer/errors.h"
#include "trainer/model_dir.h"

namespace trainer {
namespace {

Config shipped(const std::string& name) {
  Config config = load_config(test::source_path("configs/" + name));
  config.model.path = test::source_path(config.model.path);
  return config;
}

TEST(TaskKinds, EachShippedTinyConfigHasTheKindOfItsObjectiveAndModel) {
  EXPECT_EQ(task_kind(shipped("tiny-qwen2.json")).name, "text");
  EXPECT_EQ(task_kind(shipped("tiny-t5.json")).name, "text");
  EXPECT_EQ(task_kind(shipped("tiny-qwen2-chat.json")).name, "text");
  EXPECT_EQ(task_kind(shipped("tiny-qwen2-dpo.json")).name, "dpo");
  EXPECT_EQ(task_kind(shipped("tiny-vit.json")).name, "image");
  EXPECT_EQ(task_kind(shipped("tiny-clip.json")).name, "contrastive");
}

TEST(TaskKinds, EveryKindAnswersEveryQuestionAndHasItsOwnName) {
  std::set<std::string> names;
  for (const TaskKind& kind : task_kinds()) {
    SCOPED_TRACE(kind.name);
    EXPECT_TRUE(names.insert(kind.name).second) << "two kinds of one name";
    EXPECT_FALSE(kind.description.empty());
    EXPECT_TRUE(kind.recognises && kind.make && kind.plan_lines && kind.plan && kind.fixed_memory && kind.data);
    EXPECT_EQ(task_kind_named(kind.name), &kind);
  }
  // The last kind takes every config (text): no config is left without a kind.
  Config any;
  EXPECT_TRUE(task_kinds().back().recognises(any, nlohmann::json::object()));
  EXPECT_EQ(task_kind_named("no such task"), nullptr);
}

TEST(TaskKinds, APreferencePairIsTwoSequencesAndAFullFineTuneKeepsAReferenceCopyUnlessPrecomputed) {
  Config config = shipped("tiny-qwen2-dpo.json");
  const TaskKind& kind = task_kind(config);
  ASSERT_TRUE(config.lora.enabled);
  ExampleShape shape = kind.example_shape(config);
  EXPECT_EQ(shape.sequences, 2);
  EXPECT_TRUE(shape.reference_forward);
  EXPECT_FALSE(shape.reference_weights);  // LoRA: the base with the adapters off
  config.lora.enabled = false;
  EXPECT_TRUE(kind.example_shape(config).reference_weights);
  EXPECT_EQ(task_kind(shipped("tiny-qwen2.json")).example_shape(config).sequences, 1);

  // dpo.precompute_reference: the reference ran before training (its copy freed), so the plan of a full fine-tune
  // holds the model once and no reference forward.
  const auto hf = read_json_file(config.model.path + "/config.json");
  const MemoryPlan copy = plan_memory(config, hf, at::Device(at::kCPU), 0, "test", kind.example_shape(config));
  config.dpo.precompute_reference = true;
  shape = kind.example_shape(config);
  EXPECT_FALSE(shape.reference_weights);
  EXPECT_FALSE(shape.reference_forward);
  EXPECT_EQ(shape.sequences, 2);
  const MemoryPlan precomputed = plan_memory(config, hf, at::Device(at::kCPU), 0, "test", shape);
  EXPECT_GT(copy.reference_weights, 0.0);
  EXPECT_DOUBLE_EQ(precomputed.reference_weights, 0.0);
  EXPECT_DOUBLE_EQ(copy.weights - precomputed.weights, copy.reference_weights);
}

TEST(TaskKinds, AContrastiveObjectiveWithoutAClipModelIsRefusedWithAHint) {
  Config config = shipped("tiny-clip.json");
  config.model.path = test::source_path("configs/models/tiny-qwen2");
  try {
    task_kind(config);
    FAIL() << "a contrastive objective on a Qwen2 was accepted";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("CLIPModel"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace trainer
