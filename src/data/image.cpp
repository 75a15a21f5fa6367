// Image decoding with libjpeg-turbo, libpng and libwebp, converted to RGB as Pillow converts (see image.h).
//
// libjpeg and libpng report errors by longjmp. Each decoder therefore runs its library calls in a function whose
// frame holds only trivially destructible objects (the jmp_buf target), records the message, and the caller
// throws the DataError after the library state is destroyed: no C++ destructor is ever skipped by a longjmp.
#include "data/image.h"

#include <csetjmp>
#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string_view>

// clang-format off: jpeglib.h needs <cstdio> first
#include <jpeglib.h>
#include <jerror.h>
// clang-format on
#include <png.h>
#include <webp/decode.h>

#include "trainer/errors.h"

namespace trainer::data {
namespace {

[[noreturn]] void fail(const std::string& name, const std::string& what, const std::string& hint = {}) {
  throw DataError(name + ": " + what,
                  hint.empty() ? "fix or remove the file, or set data.on_bad_record = \"skip\" to count and skip bad "
                                 "images"
                               : hint);
}

void check_size(const std::string& name, std::int64_t width, std::int64_t height, std::int64_t max_pixels) {
  if (width <= 0 || height <= 0) fail(name, "the image has no pixels (" + std::to_string(width) + " x " +
                                                std::to_string(height) + ")");
  if (width * height > max_pixels)
    fail(name,
         "image of " + std::to_string(width) + " x " + std::to_string(height) + " = " +
             std::to_string(width * height) + " pixels exceeds the limit of " + std::to_string(max_pixels) +
             " pixels (a possible decompression bomb)",
         "resize the image, or remove it; the limit is Pillow's MAX_IMAGE_PIXELS");
}

// Pillow's cmyk2rgb on (already un-inverted) CMYK: r = (255 - k) - c * (255 - k) / 255, rounded as MULDIV255.
std::uint8_t cmyk_channel(int colour, int black) {
  const int nk = 255 - black;
  const int product = colour * nk + 128;
  const int scaled = ((product >> 8) + product) >> 8;
  const int value = nk - scaled;
  return static_cast<std::uint8_t>(value < 0 ? 0 : value > 255 ? 255 : value);
}

// ---- JPEG ------------------------------------------------------------------------------------------------------

struct JpegError {
  jpeg_error_mgr manager;  // first: libjpeg's err pointer is cast back to JpegError
  std::jmp_buf jump;
  char message[JMSG_LENGTH_MAX];
  bool truncated;
};

void jpeg_fatal(j_common_ptr info) {
  auto* error = reinterpret_cast<JpegError*>(info->err);
  (*info->err->format_message)(info, error->message);
  std::longjmp(error->jump, 1);
}

void jpeg_warning(j_common_ptr info, int level) {
  // Level -1 is a warning about corrupt data. A premature end of the file (libjpeg fills the rest grey) is an
  // error, as in Pillow without LOAD_TRUNCATED_IMAGES; other recoverable warnings are ignored, as Pillow does.
  auto* error = reinterpret_cast<JpegError*>(info->err);
  if (level == -1 && info->err->msg_code == JWRN_JPEG_EOF) error->truncated = true;
}

struct JpegHeader {
  int width, height, components;
  J_COLOR_SPACE space;
  int orientation;
};

// The APP1 "Exif\0\0" marker's orientation, 1 when there is none.
int jpeg_orientation(j_decompress_ptr info) {
  for (jpeg_saved_marker_ptr marker = info->marker_list; marker != nullptr; marker = marker->next) {
    if (marker->marker != JPEG_APP0 + 1 || marker->data_length < 14) continue;
    if (std::memcmp(marker->data, "Exif\0\0", 6) != 0) continue;
    return exif_orientation({marker->data + 6, marker->data_length - 6});
  }
  return 1;
}

// Phase 1: header. Returns false with error->message set on failure.
bool jpeg_read_header_safe(jpeg_decompress_struct* info, JpegError* error, const std::uint8_t* data,
                           std::size_t size, JpegHeader* header) {
  if (setjmp(error->jump)) return false;
  jpeg_create_decompress(info);
  jpeg_mem_src(info, data, static_cast<unsigned long>(size));
  jpeg_save_markers(info, JPEG_APP0 + 1, 0xFFFF);
  jpeg_read_header(info, TRUE);
  header->width = static_cast<int>(info->image_width);
  header->height = static_cast<int>(info->image_height);
  header->space = info->jpeg_color_space;
  header->orientation = jpeg_orientation(info);
  return true;
}

// Phase 2: pixels into `out` (width * height * components bytes), as gray, RGB or CMYK.
bool jpeg_read_pixels_safe(jpeg_decompress_struct* info, JpegError* error, std::uint8_t* out, int* components) {
  if (setjmp(error->jump)) return false;
  const J_COLOR_SPACE space = info->jpeg_color_space;
  info->out_color_space = space == JCS_GRAYSCALE ? JCS_GRAYSCALE
                          : (space == JCS_CMYK || space == JCS_YCCK) ? JCS_CMYK
                                                                      : JCS_RGB;
  info->dct_method = JDCT_ISLOW;  // Pillow's default, exact to the standard
  jpeg_start_decompress(info);
  *components = info->output_components;
  const std::size_t stride = static_cast<std::size_t>(info->output_width) * info->output_components;
  while (info->output_scanline < info->output_height) {
    JSAMPROW row = out + static_cast<std::size_t>(info->output_scanline) * stride;
    jpeg_read_scanlines(info, &row, 1);
  }
  jpeg_finish_decompress(info);
  return true;
}

RgbImage decode_jpeg(std::span<const std::uint8_t> bytes, const std::string& name, std::int64_t max_pixels) {
  jpeg_decompress_struct info{};
  JpegError error{};
  info.err = jpeg_std_error(&error.manager);
  error.manager.error_exit = jpeg_fatal;
  error.manager.emit_message = jpeg_warning;
  // libjpeg's state is released on every way out (jpeg_destroy on a never-created struct does nothing).
  const std::unique_ptr<jpeg_decompress_struct, decltype(&jpeg_destroy_decompress)> release(&info,
                                                                                          &jpeg_destroy_decompress);
  JpegHeader header{};
  if (!jpeg_read_header_safe(&info, &error, bytes.data(), bytes.size(), &header))
    fail(name, std::string("not a readable JPEG image (") + error.message + ")");
  check_size(name, header.width, header.height, max_pixels);
  std::vector<std::uint8_t> pixels(static_cast<std::size_t>(header.width) * header.height * 4);
  int components = 0;
  const bool ok = jpeg_read_pixels_safe(&info, &error, pixels.data(), &components);
  if (!ok) fail(name, std::string("corrupt JPEG image (") + error.message + ")");
  if (error.truncated) fail(name, "the JPEG image is truncated (the file ends before the image data does)");

  RgbImage image{header.width, header.height, {}};
  const std::size_t count = static_cast<std::size_t>(header.width) * header.height;
  if (components == 3) {
    pixels.resize(count * 3);
    image.rgb = std::move(pixels);
  } else {
    image.rgb.resize(count * 3);
    for (std::size_t i = 0; i < count; ++i) {
      std::uint8_t* out = &image.rgb[i * 3];
      if (components == 1) {
        out[0] = out[1] = out[2] = pixels[i];
      } else {
        // CMYK JPEGs are stored inverted (Adobe's convention, which Pillow always assumes).
        const std::uint8_t* in = &pixels[i * 4];
        const int black = 255 - in[3];
        for (int c = 0; c < 3; ++c) out[c] = cmyk_channel(255 - in[c], black);
      }
    }
  }
  return apply_exif_orientation(std::move(image), header.orientation);
}

// ---- PNG -------------------------------------------------------------------------------------------------------

struct PngSource {
  const std::uint8_t* data;
  std::size_t size;
  std::size_t offset;
  std::jmp_buf jump;
  char message[256];
  bool truncated;
};

void png_fatal(png_structp png, png_const_charp message) {
  auto* source = static_cast<PngSource*>(png_get_error_ptr(png));
  std::snprintf(source->message, sizeof(source->message), "%s", message);
  std::longjmp(source->jump, 1);
}

void png_warning_ignored(png_structp, png_const_charp) {}

void png_read_memory(png_structp png, png_bytep out, png_size_t length) {
  auto* source = static_cast<PngSource*>(png_get_io_ptr(png));
  if (length > source->size - source->offset) {
    source->truncated = true;
    png_error(png, "the file ends early");
  }
  std::memcpy(out, source->data + source->offset, length);
  source->offset += length;
}

struct PngHeader {
  png_uint_32 width, height;
  int channels;
  int orientation;
};

bool png_read_header_safe(png_structp png, png_infop info, PngSource* source, PngHeader* header) {
  if (setjmp(source->jump)) return false;
  png_set_read_fn(png, source, png_read_memory);
  png_set_user_limits(png, 0x7fffffff, 0x7fffffff);  // our own pixel limit applies (check_size)
  png_read_info(png, info);
  header->width = png_get_image_width(png, info);
  header->height = png_get_image_height(png, info);
  // To 8 bits per channel: palette -> RGB, gray below 8 bits scaled up (as Pillow's L;1/L;2/L;4), 16 bits -> the
  // high byte (Pillow's RGB;16B), tRNS -> an alpha channel that is dropped below like any alpha.
  png_set_expand(png);
  png_set_strip_16(png);
  png_read_update_info(png, info);
  header->channels = png_get_channels(png, info);
  header->orientation = 1;
#ifdef PNG_eXIf_SUPPORTED
  png_uint_32 exif_length = 0;
  png_bytep exif = nullptr;
  if (png_get_eXIf_1(png, info, &exif_length, &exif) != 0 && exif != nullptr)
    header->orientation = exif_orientation({exif, exif_length});
#endif
  return true;
}

bool png_read_pixels_safe(png_structp png, png_infop info, PngSource* source, std::uint8_t* out,
                          std::size_t stride, png_uint_32 height) {
  if (setjmp(source->jump)) return false;
  const int passes = png_set_interlace_handling(png);
  for (int pass = 0; pass < passes; ++pass)
    for (png_uint_32 y = 0; y < height; ++y) png_read_row(png, out + y * stride, nullptr);
  png_read_end(png, info);
  return true;
}

RgbImage decode_png(std::span<const std::uint8_t> bytes, const std::string& name, std::int64_t max_pixels) {
  PngSource source{};
  source.data = bytes.data();
  source.size = bytes.size();
  png_structp png = png_create_read_struct(PNG_LIBPNG_VER_STRING, &source, png_fatal, png_warning_ignored);
  png_infop info = png ? png_create_info_struct(png) : nullptr;
  if (png == nullptr || info == nullptr) {
    png_destroy_read_struct(&png, &info, nullptr);
    throw std::bad_alloc();
  }
  // libpng's state is released on every way out.
  struct Release {
    png_structp& png;
    png_infop& info;
    ~Release() { png_destroy_read_struct(&png, &info, nullptr); }
  } release{png, info};
  PngHeader header{};
  if (!png_read_header_safe(png, info, &source, &header)) {
    if (source.truncated) fail(name, "the PNG image is truncated (the file ends inside its header)");
    fail(name, std::string("not a readable PNG image (") + source.message + ")");
  }
  check_size(name, header.width, header.height, max_pixels);
  const std::size_t stride = static_cast<std::size_t>(header.width) * header.channels;
  std::vector<std::uint8_t> pixels(stride * header.height);
  const bool ok = png_read_pixels_safe(png, info, &source, pixels.data(), stride, header.height);
  if (!ok && source.truncated) fail(name, "the PNG image is truncated (the file ends before the image data does)");
  if (!ok) fail(name, std::string("corrupt PNG image (") + source.message + ")");

  RgbImage image{static_cast<int>(header.width), static_cast<int>(header.height), {}};
  const std::size_t count = static_cast<std::size_t>(header.width) * header.height;
  const int channels = header.channels;
  if (channels == 3) {
    image.rgb = std::move(pixels);
  } else {
    image.rgb.resize(count * 3);
    for (std::size_t i = 0; i < count; ++i) {
      const std::uint8_t* in = &pixels[i * channels];
      std::uint8_t* out = &image.rgb[i * 3];
      if (channels <= 2) {  // gray or gray + alpha: replicated, alpha dropped
        out[0] = out[1] = out[2] = in[0];
      } else {  // RGBA: alpha dropped
        out[0] = in[0];
        out[1] = in[1];
        out[2] = in[2];
      }
    }
  }
  return apply_exif_orientation(std::move(image), header.orientation);
}

// ---- WebP ------------------------------------------------------------------------------------------------------

RgbImage decode_webp(std::span<const std::uint8_t> bytes, const std::string& name, std::int64_t max_pixels) {
  int width = 0, height = 0;
  if (!WebPGetInfo(bytes.data(), bytes.size(), &width, &height)) fail(name, "not a readable WebP image");
  check_size(name, width, height, max_pixels);
  RgbImage image{width, height, std::vector<std::uint8_t>(static_cast<std::size_t>(width) * height * 3)};
  if (WebPDecodeRGBInto(bytes.data(), bytes.size(), image.rgb.data(), image.rgb.size(), width * 3) == nullptr)
    fail(name, "corrupt or truncated WebP image");
  return image;
}

std::uint32_t read_u16(const std::uint8_t* p, bool little) {
  return little ? (p[0] | (p[1] << 8)) : ((p[0] << 8) | p[1]);
}
std::uint32_t read_u32(const std::uint8_t* p, bool little) {
  return little ? (p[0] | (p[1] << 8) | (p[2] << 16) | (static_cast<std::uint32_t>(p[3]) << 24))
                : ((static_cast<std::uint32_t>(p[0]) << 24) | (p[1] << 16) | (p[2] << 8) | p[3]);
}

}  // namespace

ImageFormat sniff_image_format(std::span<const std::uint8_t> bytes) {
  if (bytes.size() >= 3 && bytes[0] == 0xFF && bytes[1] == 0xD8 && bytes[2] == 0xFF) return ImageFormat::kJpeg;
  static constexpr std::uint8_t kPng[8] = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1A, '\n'};
  if (bytes.size() >= 8 && std::memcmp(bytes.data(), kPng, 8) == 0) return ImageFormat::kPng;
  if (bytes.size() >= 12 && std::memcmp(bytes.data(), "RIFF", 4) == 0 && std::memcmp(bytes.data() + 8, "WEBP", 4) == 0)
    return ImageFormat::kWebp;
  return ImageFormat::kUnknown;
}

int exif_orientation(std::span<const std::uint8_t> tiff) {
  if (tiff.size() < 8) return 1;
  const bool little = tiff[0] == 'I' && tiff[1] == 'I';
  if (!little && !(tiff[0] == 'M' && tiff[1] == 'M')) return 1;
  if (read_u16(&tiff[2], little) != 42) return 1;
  const std::uint32_t ifd = read_u32(&tiff[4], little);
  if (ifd > tiff.size() - 2) return 1;
  const std::uint32_t entries = read_u16(&tiff[ifd], little);
  for (std::uint32_t i = 0; i < entries; ++i) {
    const std::size_t entry = ifd + 2 + static_cast<std::size_t>(i) * 12;
    if (entry + 12 > tiff.size()) break;
    if (read_u16(&tiff[entry], little) != 0x0112) continue;
    const std::uint32_t type = read_u16(&tiff[entry + 2], little);
    const int value = static_cast<int>(type == 3 ? read_u16(&tiff[entry + 8], little) : read_u32(&tiff[entry + 8], little));
    return value >= 1 && value <= 8 ? value : 1;
  }
  return 1;
}

RgbImage apply_exif_orientation(RgbImage image, int orientation) {
  if (orientation < 2 || orientation > 8) return image;
  const int w = image.width, h = image.height;
  const bool swap = orientation >= 5;  // transposing orientations exchange width and height
  RgbImage out{swap ? h : w, swap ? w : h, std::vector<std::uint8_t>(image.rgb.size())};
  for (int y = 0; y < out.height; ++y) {
    for (int x = 0; x < out.width; ++x) {
      int sx = x, sy = y;  // the source pixel of output (x, y), per Pillow's exif_transpose method for the tag
      switch (orientation) {
        case 2: sx = w - 1 - x; break;                    // FLIP_LEFT_RIGHT
        case 3: sx = w - 1 - x; sy = h - 1 - y; break;    // ROTATE_180
        case 4: sy = h - 1 - y; break;                    // FLIP_TOP_BOTTOM
        case 5: sx = y; sy = x; break;                    // TRANSPOSE
        case 6: sx = y; sy = h - 1 - x; break;            // ROTATE_270 (clockwise)
        case 7: sx = w - 1 - y; sy = h - 1 - x; break;    // TRANSVERSE
        case 8: sx = w - 1 - y; sy = x; break;            // ROTATE_90 (counter-clockwise)
      }
      std::memcpy(&out.rgb[(static_cast<std::size_t>(y) * out.width + x) * 3],
                  &image.rgb[(static_cast<std::size_t>(sy) * w + sx) * 3], 3);
    }
  }
  return out;
}

RgbImage decode_image(std::span<const std::uint8_t> bytes, const std::string& name, std::int64_t max_pixels) {
  if (bytes.empty()) fail(name, "the file is empty (0 bytes), not an image");
  switch (sniff_image_format(bytes)) {
    case ImageFormat::kJpeg: return decode_jpeg(bytes, name, max_pixels);
    case ImageFormat::kPng: return decode_png(bytes, name, max_pixels);
    case ImageFormat::kWebp: return decode_webp(bytes, name, max_pixels);
    case ImageFormat::kUnknown: break;
  }
  std::string start;
  for (std::size_t i = 0; i < std::min<std::size_t>(bytes.size(), 8); ++i) {
    char hex[4];
    std::snprintf(hex, sizeof(hex), "%02x", bytes[i]);
    start += hex;
  }
  fail(name, "not a JPEG, PNG or WebP image (the file starts with bytes " + start + ")",
       "convert it to JPEG or PNG, or remove it; or set data.on_bad_record = \"skip\" to count and skip bad images");
}

RgbImage load_image_file(const std::string& path, std::int64_t max_pixels) {
  std::error_code error;
  const auto status = std::filesystem::status(path, error);
  if (error || !std::filesystem::exists(status))
    fail(path, "cannot open the image file (" + (error ? error.message() : std::string("No such file or directory")) +
                   ")",
         "check the path and its permissions");
  if (!std::filesystem::is_regular_file(status))
    fail(path, "is not a regular file (a directory or a device), not an image", "check the path");
  std::ifstream in(path, std::ios::binary);
  if (!in) fail(path, std::string("cannot open the image file (") + std::strerror(errno) + ")",
                "check the path and its permissions");
  const auto size = std::filesystem::file_size(path, error);
  if (error) fail(path, "cannot read the image file (" + error.message() + ")", "check the path and its permissions");
  std::vector<std::uint8_t> bytes(static_cast<std::size_t>(size));
  if (size > 0 && !in.read(reinterpret_cast<char*>(bytes.data()), static_cast<std::streamsize>(size)))
    fail(path, std::string("cannot read the image file (") + std::strerror(errno) + ")",
         "check the path and its permissions");
  return decode_image(bytes, path, max_pixels);
}

}  // namespace trainer::data
