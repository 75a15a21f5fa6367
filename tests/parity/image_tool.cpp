// The image parity tests' helper (tests/parity/test_images.py): runs our decoder and preprocessing on files so
// pytest can compare them with Pillow and transformers' image processors.
//
//   trainer_image_tool decode FILE OUT                   8-bit RGB of FILE
//   trainer_image_tool resize FILE WIDTH HEIGHT FILTER OUT   FILE decoded, resized (FILTER: Pillow's number)
//   trainer_image_tool preprocess MODEL_DIR FILE OUT_U8 OUT_F32   resize + crop (8-bit), and the float tensor
//   trainer_image_tool list SOURCES CLASSES skip|error OUT.json
//       the dataset of SOURCES (comma-separated folders/JSONL) with CLASSES (comma-separated, or - for none):
//       {"classes", "records": [[path, label, origin]...], "bad_records_skipped", "other_files"}
//   trainer_image_tool decode-batch SOURCES CLASSES MODEL_DIR THREADS skip|error OUT_F32 OUT.json
//       every record decoded and preprocessed on THREADS threads: the pixels (float32, N x 3 x H x W, header
//       width/height of one image; OUT_F32 "-": not written) and {"labels", "kept", "problems"}
//   trainer_image_tool batch                            one command a line on stdin; answers "ok" or
//                                                       "error <message>" a line on stdout
// Raw files: int32 width, int32 height (little-endian), then the pixels (RGB interleaved, or float32 CHW).
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "data/image.h"
#include "data/image_dataset.h"
#include "data/image_preprocess.h"
#include "trainer/errors.h"

namespace {

using trainer::data::RgbImage;

void write_raw(const std::string& path, int width, int height, const void* data, std::size_t bytes) {
  std::ofstream out(path, std::ios::binary);
  const std::int32_t header[2] = {width, height};
  out.write(reinterpret_cast<const char*>(header), sizeof(header));
  out.write(static_cast<const char*>(data), static_cast<std::streamsize>(bytes));
  if (!out) throw std::runtime_error("cannot write " + path);
}

std::vector<std::string> split_commas(const std::string& text) {
  std::vector<std::string> out;
  if (text == "-") return out;
  std::stringstream in(text);
  for (std::string item; std::getline(in, item, ',');) out.push_back(item);
  return out;
}

void run(const std::vector<std::string>& args) {
  if (args.empty()) throw std::runtime_error("no command");
  const std::string& command = args[0];
  if (command == "decode" && args.size() == 3) {
    const RgbImage image = trainer::data::load_image_file(args[1]);
    write_raw(args[2], image.width, image.height, image.rgb.data(), image.rgb.size());
  } else if (command == "resize" && args.size() == 6) {
    const RgbImage image = trainer::data::load_image_file(args[1]);
    const RgbImage out = trainer::data::resize_image(image, std::stoi(args[2]), std::stoi(args[3]),
                                                     static_cast<trainer::data::Resample>(std::stoi(args[4])));
    write_raw(args[5], out.width, out.height, out.rgb.data(), out.rgb.size());
  } else if (command == "preprocess" && args.size() == 5) {
    const auto spec = trainer::data::read_image_processor(args[1]);
    const RgbImage image = trainer::data::load_image_file(args[2]);
    const RgbImage ready = trainer::data::resize_and_crop(image, spec);
    write_raw(args[3], ready.width, ready.height, ready.rgb.data(), ready.rgb.size());
    const auto [height, width] = spec.output_size();
    std::vector<float> tensor(static_cast<std::size_t>(3) * height * width);
    trainer::data::preprocess_image(image, spec, tensor.data());
    write_raw(args[4], width, height, tensor.data(), tensor.size() * sizeof(float));
  } else if (command == "list" && args.size() == 5) {
    const auto dataset = trainer::data::open_image_dataset(split_commas(args[1]), split_commas(args[2]), args[3] == "skip");
    nlohmann::json out = {{"classes", dataset.classes}, {"records", nlohmann::json::array()},
                          {"bad_records_skipped", dataset.bad_records_skipped}, {"other_files", dataset.other_files}};
    for (const auto& r : dataset.records) out["records"].push_back({r.path, r.label, r.origin});
    std::ofstream(args[4]) << out.dump();
  } else if (command == "decode-batch" && args.size() == 8) {
    const bool skip = args[5] == "skip";
    const auto dataset = trainer::data::open_image_dataset(split_commas(args[1]), split_commas(args[2]), skip);
    const auto spec = trainer::data::read_image_processor(args[3]);
    std::vector<std::size_t> indices(dataset.records.size());
    for (std::size_t i = 0; i < indices.size(); ++i) indices[i] = i;
    const auto decoded = trainer::data::decode_images(dataset, indices, spec, std::stoi(args[4]), skip);
    const auto [height, width] = spec.output_size();
    if (args[6] != "-") write_raw(args[6], width, height, decoded.pixels.data(), decoded.pixels.size() * sizeof(float));
    std::ofstream(args[7]) << nlohmann::json{{"labels", decoded.labels}, {"kept", decoded.kept},
                                             {"problems", decoded.problems}}.dump();
  } else {
    throw std::runtime_error("unknown command or wrong arguments: " + command);
  }
}

std::vector<std::string> split(const std::string& line) {
  std::vector<std::string> words;
  std::istringstream in(line);
  for (std::string word; in >> word;) words.push_back(word);
  return words;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  if (args.size() == 1 && args[0] == "batch") {
    for (std::string line; std::getline(std::cin, line);) {
      try {
        run(split(line));
        std::cout << "ok\n";
      } catch (const std::exception& e) {
        std::string message = e.what();
        for (char& c : message)
          if (c == '\n') c = ' ';
        std::cout << "error " << message << "\n";
      }
      std::cout.flush();
    }
    return 0;
  }
  try {
    run(args);
  } catch (const trainer::Error& e) {
    std::cerr << "error: " << e.what() << "\n";
    return e.exit_code();
  } catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
