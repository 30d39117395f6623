#include "qkv/viz/colormap.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "qkv/core/error.hpp"

namespace qkv {
namespace {

using Samples = std::array<Rgb, kColormapSamples>;

// matplotlib's tables interpolated at t = k/32 (position 255 k/32 of 256 entries) and rounded to
// 8 bits; linear interpolation between these stays within 2/255 of the full tables.
constexpr Samples kViridis = {{
    {68, 1, 84},    {71, 13, 96},   {72, 24, 106},  {72, 35, 116},  {71, 45, 123},  {69, 54, 129},  {66, 64, 134},
    {63, 73, 137},  {59, 82, 139},  {55, 90, 141},  {51, 99, 141},  {47, 106, 142}, {44, 114, 142}, {41, 122, 142},
    {38, 129, 142}, {35, 137, 142}, {33, 144, 140}, {31, 152, 139}, {31, 159, 136}, {33, 166, 133}, {40, 174, 128},
    {49, 181, 123}, {62, 188, 116}, {76, 194, 108}, {93, 201, 99},  {110, 206, 88}, {130, 211, 76}, {150, 216, 63},
    {171, 220, 50}, {192, 223, 36}, {213, 226, 26}, {234, 229, 26}, {253, 231, 37},
}};

constexpr Samples kMagma = {{
    {0, 0, 4},       {3, 3, 17},      {10, 8, 34},     {19, 13, 51},    {29, 17, 70},    {40, 17, 90},
    {54, 16, 106},   {67, 15, 118},   {80, 18, 124},   {93, 23, 127},   {105, 28, 129},  {118, 33, 129},
    {130, 38, 129},  {143, 42, 129},  {156, 46, 127},  {169, 50, 125},  {182, 55, 121},  {195, 59, 117},
    {207, 65, 112},  {219, 72, 106},  {230, 81, 99},   {238, 92, 94},   {245, 105, 92},  {249, 120, 93},
    {251, 135, 97},  {253, 150, 104}, {254, 165, 113}, {254, 180, 123}, {254, 195, 135}, {254, 209, 148},
    {253, 224, 162}, {252, 238, 176}, {252, 253, 191},
}};

constexpr Samples gray_samples() {
  Samples samples{};
  for (int k = 0; k < kColormapSamples; ++k) {
    // round(255 k / 32) in integers: the grey levels a linear ramp passes through.
    const auto level = static_cast<uint8_t>((255 * k + 16) / 32);
    samples[static_cast<size_t>(k)] = {level, level, level};
  }
  return samples;
}
constexpr Samples kGray = gray_samples();

// Kenneth Moreland's cool-warm ends and middle ("Diverging Color Maps for Scientific Visualization",
// 2009), interpolated linearly in sRGB: both ends are about as light (L* 48 and 42), the middle
// lightest, so equal magnitudes of either sign look equally strong.
constexpr Samples coolwarm_samples() {
  constexpr Rgb kCool{59, 76, 192}, kMiddle{221, 221, 221}, kWarm{180, 4, 38};
  Samples samples{};
  for (int k = 0; k < kColormapSamples; ++k) {
    const bool upper = k > 16;
    const Rgb& a = upper ? kMiddle : kCool;
    const Rgb& b = upper ? kWarm : kMiddle;
    const int step = upper ? k - 16 : k;  // 0..16 along the half
    const auto mix = [step](uint8_t x, uint8_t y) {
      return static_cast<uint8_t>((x * (16 - step) + y * step + 8) / 16);
    };
    samples[static_cast<size_t>(k)] = {mix(a.r, b.r), mix(a.g, b.g), mix(a.b, b.b)};
  }
  return samples;
}
constexpr Samples kCoolwarm = coolwarm_samples();

const Samples& samples_of(Colormap map) {
  switch (map) {
    case Colormap::magma:
      return kMagma;
    case Colormap::gray:
      return kGray;
    case Colormap::coolwarm:
      return kCoolwarm;
    case Colormap::viridis:
      break;
  }
  return kViridis;
}

}  // namespace

bool colormap_is_diverging(Colormap map) { return map == Colormap::coolwarm; }

std::string_view colormap_name(Colormap map) {
  switch (map) {
    case Colormap::magma:
      return "magma";
    case Colormap::gray:
      return "gray";
    case Colormap::coolwarm:
      return "coolwarm";
    case Colormap::viridis:
      break;
  }
  return "viridis";
}

Colormap parse_colormap(std::string_view name, std::string_view arg) {
  for (const Colormap map : kColormaps) {
    if (colormap_name(map) == name) return map;
  }
  throw ValueError(fmt::format("{}: expected viridis, magma, gray or coolwarm, got {}", arg, name));
}

Rgb colormap_at(Colormap map, double t) {
  const Samples& samples = samples_of(map);
  const double x = (std::isnan(t) ? 0.0 : std::clamp(t, 0.0, 1.0)) * static_cast<double>(samples.size() - 1);
  const auto i = std::min(static_cast<size_t>(x), samples.size() - 2);
  const double f = x - static_cast<double>(i);
  const auto mix = [f](uint8_t a, uint8_t b) { return static_cast<uint8_t>(std::lround(a + f * (b - a))); };
  return {mix(samples[i].r, samples[i + 1].r), mix(samples[i].g, samples[i + 1].g),
          mix(samples[i].b, samples[i + 1].b)};
}

std::array<Rgb, kColormapSamples> colormap_samples(Colormap map) { return samples_of(map); }

Rgb viridis(double t) { return colormap_at(Colormap::viridis, t); }

double luma(Rgb c) { return 0.2126 * c.r + 0.7152 * c.g + 0.0722 * c.b; }

}  // namespace qkv
