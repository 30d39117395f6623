#pragma once
// Colour maps: a value's position t in [0, 1] on a scale → an sRGB colour. Shared by the terminal
// heatmap (ANSI backgrounds) and the image heatmaps (PNG, SVG, PDF, HTML), so that one value has
// one colour wherever it is drawn.
//
//   viridis  matplotlib's default: dark purple → teal → yellow, perceptually uniform, readable in
//            grey and by colour-blind readers;
//   magma    black → purple → orange → pale yellow, perceptually uniform, with a darker bottom that
//            makes small weights recede;
//   gray     black → white, for print;
//   coolwarm blue → light grey → red (Moreland's diverging map), for signed values around 0.
// viridis and magma are interpolated from 33 samples (t = k/32) of matplotlib's 256-entry tables
// (CC0, by Stéfan van der Walt, Nathaniel Smith and Eric Firing), within 2/255 of the full tables.

#include <array>
#include <cstdint>
#include <string_view>

namespace qkv {

struct Rgb {
  uint8_t r = 0, g = 0, b = 0;
  friend bool operator==(const Rgb&, const Rgb&) = default;
};

// viridis, magma and gray are sequential: lightness rises from 0 to 1, for weights (α >= 0).
// coolwarm is diverging: blue below the middle, white-grey at it, red above, for signed matrices
// (scores, biases, gradients), whose scale then centres on 0.
enum class Colormap { viridis, magma, gray, coolwarm };

inline constexpr std::array<Colormap, 4> kColormaps = {Colormap::viridis, Colormap::magma, Colormap::gray,
                                                       Colormap::coolwarm};

// Whether `map` is diverging (its middle is 0 of a signed scale) rather than sequential.
bool colormap_is_diverging(Colormap map);

// "viridis", "magma", "gray", "coolwarm"
std::string_view colormap_name(Colormap map);

// The map called `name`; ValueError naming `arg` and listing the maps otherwise
// ("--cmap: expected viridis, magma, gray or coolwarm, got jet").
Colormap parse_colormap(std::string_view name, std::string_view arg);

// The colour of `map` at t in [0, 1] (clamped; NaN reads as 0).
Rgb colormap_at(Colormap map, double t);

// The samples the map interpolates between, at t = k/32: what a gradient needs as its stops to
// reproduce colormap_at exactly between them.
inline constexpr int kColormapSamples = 33;
std::array<Rgb, kColormapSamples> colormap_samples(Colormap map);

// colormap_at(Colormap::viridis, t), the terminal heatmap's map.
Rgb viridis(double t);

// Rec. 709 luma of the sRGB values, 0 to 255: above 128 a colour reads as light, so text on it is
// drawn black, and white otherwise.
double luma(Rgb c);

}  // namespace qkv
