// Image files -> 8-bit RGB pixels, as Pillow's `Image.open(f)`, `ImageOps.exif_transpose` and `.convert("RGB")`
// give them (what transformers' `load_image` does): JPEG through libjpeg-turbo, PNG through libpng, WebP through
// libwebp. Grayscale is replicated, palette looked up, alpha dropped (not composited), CMYK converted with
// Pillow's formula, EXIF orientation applied. Bad files are DataErrors naming the file. Thread-safe, no LibTorch.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace trainer::data {

// Interleaved RGB, rows top to bottom: pixel (x, y) channel c is rgb[(y * width + x) * 3 + c].
struct RgbImage {
  int width = 0;
  int height = 0;
  std::vector<std::uint8_t> rgb;
};

// Pillow's decompression-bomb threshold (`PIL.Image.MAX_IMAGE_PIXELS`): larger images are refused before any
// pixel memory is allocated.
inline constexpr std::int64_t kMaxImagePixels = 89'478'485;

enum class ImageFormat { kUnknown, kJpeg, kPng, kWebp };

// The format from the file's first bytes (the extension is not trusted).
ImageFormat sniff_image_format(std::span<const std::uint8_t> bytes);

// Decodes `bytes`; `name` (the file) starts every error message. Throws DataError for an empty, truncated,
// corrupt, unsupported or oversized (> max_pixels) image.
RgbImage decode_image(std::span<const std::uint8_t> bytes, const std::string& name,
                      std::int64_t max_pixels = kMaxImagePixels);

// Reads and decodes the file at `path` (DataError when it cannot be read).
RgbImage load_image_file(const std::string& path, std::int64_t max_pixels = kMaxImagePixels);

// EXIF orientation (1..8) applied as `ImageOps.exif_transpose` does; 1 and unknown values leave the image alone.
RgbImage apply_exif_orientation(RgbImage image, int orientation);

// The orientation tag (0x0112) of a TIFF-structured EXIF block (starting at "II*\0"/"MM\0*"); 1 when absent.
int exif_orientation(std::span<const std::uint8_t> tiff);

}  // namespace trainer::data
