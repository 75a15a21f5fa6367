// Image-classification datasets: which files, which class each is, and decoding a batch of them on worker
// threads. Sources are image folders (one subfolder per class, classes sorted by name, as torchvision's
// ImageFolder), JSONL files of {"image": "path", "label": "daisy" | 3} (paths relative to the JSONL file), or
// Parquet / Arrow files (datasets' save_to_disk shards; callers expand DIR and DIR:SPLIT with expand_globs) with an
// "image" column (datasets' Image feature: encoded bytes, held in memory, or a path) and a "label" column (a class
// name, a number, or a ClassLabel, whose names are the classes).
// Bad records and bad images stop with a `file: what` DataError, or are counted and skipped (skip_bad). No LibTorch.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "data/image_preprocess.h"

namespace trainer::data {

struct ImageRecord {
  std::string path;     // the image file
  std::int64_t label;   // index into ImageDataset::classes
  std::string origin;   // where the record came from, for messages: the JSONL "file:line", the image path, or a
                        // table's "file: row R (row group G)"
  std::string bytes;    // a table's encoded image (datasets' Image feature), decoded from memory; empty: `path`
};

struct ImageDataset {
  std::vector<std::string> classes;   // class names by label id
  std::vector<ImageRecord> records;   // folder: class by class, files sorted by path; JSONL: file order
  std::int64_t bad_records_skipped = 0;  // JSONL records (and labels) skipped with skip_bad
  std::int64_t other_files = 0;          // files in an image folder that are not .jpg/.jpeg/.png/.webp (counted,
                                         // not read: README.txt, .DS_Store, ...)
  // Image-caption data (open_caption_dataset): records[i]'s caption; a record without a label has label -1.
  std::vector<std::string> captions;
};

// Reads the sources. `classes` fixes the class list (a validation set must use the training set's; a model's
// id2label); empty: the folder's subfolders sorted by name, or the JSONL's string labels sorted (integer labels:
// 0..max). A label that is not a known class, an integer out of range, a missing "image"/"label" field or invalid
// JSON is a DataError naming file:line (folder: the class folder), or is counted and skipped with skip_bad.
ImageDataset open_image_dataset(const std::vector<std::string>& sources, const std::vector<std::string>& classes,
                                bool skip_bad);

// Image-caption pairs for contrastive training: JSONL files of {"image": "path", "caption": "a photo of ...",
// "label": "optional class name"} (paths relative to the JSONL file). Labels (for zero-shot evaluation) are
// optional; the classes are the label names sorted (or `classes` when given). A record without an "image" path or a
// non-empty "caption" string, with a label that is not a string, or invalid JSON is a DataError naming file:line,
// or is counted and skipped with skip_bad. Image folders are refused: they have no captions.
ImageDataset open_caption_dataset(const std::vector<std::string>& sources, const std::vector<std::string>& classes,
                                  bool skip_bad);

// Whether a path names an image folder (a directory that is not a folder `datasets` wrote: none of
// dataset_dict.json, state.json, dataset_info.json) rather than a JSONL, Parquet or Arrow file.
bool is_image_folder(const std::string& source);

// A decoded, preprocessed batch: pixels of the kept records (kept.size() x 3 x H x W float32, channel-first),
// their labels, the positions (into the requested indices) that were kept, and what was wrong with the others.
struct DecodedImages {
  std::vector<float> pixels;
  std::vector<std::int64_t> labels;
  std::vector<std::size_t> kept;
  std::vector<std::string> problems;  // "file: what", one per skipped image
};

// Training augmentation (data.augment): a random resized crop (torchvision's RandomResizedCrop: 8%-100% of the
// area, aspect ratio 3/4-4/3, 10 tries, then the largest centred crop within those ratios) resized to the spec's
// output size with its resampling filter, and a horizontal flip with probability 1/2. Every choice is drawn from
// (seed, epoch, record index) alone, so the thread, the batch split and a resume never change an image.
struct ImageAugment {
  std::uint64_t seed = 0;
  std::int64_t epoch = 0;
};

// The crop window (left, top, width, height) and flip of record `index` (exposed for tests).
struct AugmentDraw {
  int left = 0, top = 0, width = 0, height = 0;
  bool flip = false;
};
AugmentDraw draw_augment(const ImageAugment& augment, std::size_t index, int image_width, int image_height);

// Preprocesses one image with augmentation: crop, flip, resize to spec.output_size(), rescale, normalise.
void augment_image(const RgbImage& image, const ImageProcessorSpec& spec, const AugmentDraw& draw, float* out);

// Decodes and preprocesses records `indices` of `dataset` on `threads` worker threads (each image independent,
// results in index order whatever the thread count). A bad image throws its DataError (the first in index order),
// or with skip_bad is left out and described in `problems`. With `augment`, training augmentation replaces the
// spec's resize and crop (ImageAugment).
DecodedImages decode_images(const ImageDataset& dataset, const std::vector<std::size_t>& indices,
                            const ImageProcessorSpec& spec, int threads, bool skip_bad,
                            const ImageAugment* augment = nullptr);

}  // namespace trainer::data
