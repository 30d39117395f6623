#pragma once
// Helpers shared by the qkv subcommands: reading .npy inputs as float32 tensors, refusing
// non-finite values, writing outputs so that a failed run leaves no file behind, and the colours
// --color asks of the terminal.
//
// Every error names the option at fault ("--q", "-o"), what was expected and what came, and is a
// qkv::Error, which main() prints as one line with exit code 2.

#include <cstdint>
#include <filesystem>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include "qkv/core/error.hpp"
#include "qkv/core/tensor.hpp"
#include "qkv/io/npy.hpp"
#include "qkv/ops/attention.hpp"
#include "qkv/viz/heatmap.hpp"

namespace qkv::cli {

// ---- Inputs ---------------------------------------------------------------------------------

// The dtypes an option reading floats takes, as its messages list them.
inline constexpr std::string_view kFloatDtypes = "float32 or float64";

// Reads the .npy file given to option `arg`, which takes the dtypes `accepted` ("float32 or
// float64"). A missing, unreadable or malformed file raises IoError "`arg`: <path>: <what is
// wrong>"; a dtype the reader cannot read at all says also what `arg` takes, since the reader's
// own list is wider than most options'.
// "-" is refused rather than read as a file of that name: it would look like standard input,
// which a binary .npy is never read from.
NpyArray read_input(const std::filesystem::path& path, std::string_view arg, std::string_view accepted);

// The array as a float32 tensor of rank 0 to 4. float32 is taken as is and float64 is rounded;
// any other dtype is a ShapeError, and a finite float64 value beyond float32's range is a
// ValueError (it would turn into an infinity that was not in the file).
Tensor<float> to_float32(NpyArray array, std::string_view arg);

// The array as a float64 tensor of rank 0 to 4: float64 as is, float32 widened exactly; any other
// dtype is a ShapeError.
Tensor<double> to_float64(NpyArray array, std::string_view arg);

// A bool, uint8, int32 or int64 array as a tensor of 0/1 bytes (nonzero = 1), rank 0 to 4; any other
// dtype is a ShapeError.
Tensor<uint8_t> to_bool(NpyArray array, std::string_view arg);

// An int32 or int64 array as an int64 tensor of rank 0 to 4 (int32 widened); any other dtype is a
// ShapeError.
Tensor<int64_t> to_int64(NpyArray array, std::string_view arg);

// The shape of an array read from disk as a qkv Shape, which holds rank 0 to 4; ShapeError naming
// `arg` otherwise.
Shape shape_of(const NpyArray& array, std::string_view arg);

// read_input then to_float32: the usual way to take a float operand.
Tensor<float> load_float32(const std::filesystem::path& path, std::string_view arg);

// to_float32 or to_float64, for a run in T.
template <class T>
Tensor<T> to_tensor(NpyArray array, std::string_view arg) {
  if constexpr (std::is_same_v<T, double>) {
    return to_float64(std::move(array), arg);
  } else {
    return to_float32(std::move(array), arg);
  }
}

// The dtypes a --mask takes, as its messages list them.
inline constexpr std::string_view kMaskDtypes =
    "bool, uint8, int32 or int64 (nonzero = may attend) or float32/float64 (a bias)";

// A mask as read: a bool or integer array says which keys a query may attend to (`allowed`), a
// float one is a bias added to the scores, where -inf masks the key.
template <class T>
struct MaskArrays {
  std::optional<Tensor<uint8_t>> allowed;
  std::optional<Tensor<T>> bias;

  const Shape& shape() const { return allowed ? allowed->shape() : bias->shape(); }
};

// The array given to `arg` as a mask (kMaskDtypes); a ShapeError naming `arg` for any other dtype.
template <class T>
MaskArrays<T> to_mask(NpyArray array, std::string_view arg);

// A ShapeError naming `arg` unless `shape` broadcasts to the scores `scores`, which the message
// calls `scores_dims` ("[B, H, Tq, Tk]").
void expect_broadcasts(std::string_view arg, const Shape& shape, const Shape& scores, std::string_view scores_dims);

// ALiBi's slopes as option `arg` gives them: "auto" for the standard slopes of `heads` heads, or a
// .npy file of one slope per head, refused (naming `arg`) with any other shape.
template <class T>
Tensor<T> read_alibi(const std::string& value, std::string_view arg, int64_t heads);

inline constexpr std::string_view kAllowNonfiniteRemedy = "pass --allow-nonfinite to accept them";

// check_finite (qkv/core/tensor.hpp, qkv/core/storage.hpp) with the CLI's remedy: the message suggests
// --allow-nonfinite, so a subcommand calling this offers that flag.
template <class T>
void check_input_finite(TensorView<const T> values, std::string_view arg, NonFinite rule = NonFinite::refused) {
  check_finite(values, arg, rule, kAllowNonfiniteRemedy);
}
inline void check_input_finite(const StoredView& values, std::string_view arg) {
  check_finite(values, arg, kAllowNonfiniteRemedy);
}

// The tokens in the text file given to option `arg` (--tokens-file): one per line, UTF-8, kept as
// written (spaces inside a token included), "\r\n" read as a line break and the last line's break
// optional. IoError naming `arg` and the path for a file that cannot be read; ValueError naming
// `arg`, the path and the line number for a blank line (empty or white space only) or one that is
// not UTF-8, and for a file without tokens.
std::vector<std::string> read_tokens_file(const std::filesystem::path& path, std::string_view arg);

// ---- Batches of any rank ---------------------------------------------------------------------

// The leading dims of a run beyond the two that qkv's tensors hold ([B, H, T, D]): Q of shape
// [L1, ..., Ln, H, Tq, Dk] with n >= 2 runs as [L1*...*Ln, H, Tq, Dk], as torch reads `...`, and
// every output is written with L1, ..., Ln again. Empty when Q has rank 4 or less.
struct Batch {
  std::vector<int64_t> dims;

  // An output's shape as written: [L1*...*Ln, rest...] computed is [L1, ..., Ln, rest...] in the file.
  std::vector<int64_t> file_shape(const Shape& computed) const;
};

// Q's batch: its dims before the last three, when it has more than four. A ShapeError for rank 0 or 1.
Batch batch_of(const NpyArray& q, std::string_view arg);

// K, V, dOut or Q itself reshaped from [L1, ..., Ln, X, Y, Z] to [L1*...*Ln, X, Y, Z]. A ShapeError
// names `arg` when its leading dims are not the batch's; `meaning` says what they should be.
void flatten_batch(NpyArray& array, const Batch& batch, std::string_view arg, std::string_view meaning);

// How a mask given with batch dims runs: `shape` is its own (and its gradient's), and `expanded`
// says that its batch dims mixed 1 and L_i, so it was copied to all L1*...*Ln entries (the
// gradient then sums over the copies).
struct BatchedMask {
  std::vector<int64_t> shape;
  bool expanded = false;
};

// A mask that broadcasts to the scores [L1, ..., Ln, H, Tq, Tk] (`scores`), reshaped to broadcast
// to [L1*...*Ln, H, Tq, Tk]: batch dims all 1 or all L_i become one dim, any other mix is expanded.
// A ShapeError names --mask when it does not broadcast.
BatchedMask flatten_mask_batch(NpyArray& mask, const Batch& batch, std::span<const int64_t> scores);

// The gradient of an expanded mask, [L1*...*Ln, H', Tq', Tk'], summed over the copies back into the
// mask's own shape (as a tensor of that many elements: write it with `mask.shape`).
template <class T>
Tensor<T> sum_expanded_mask_gradient(const Tensor<T>& gradient, const Batch& batch, const BatchedMask& mask);

// ---- Outputs --------------------------------------------------------------------------------

// A zero-filled float32 or float64 tensor for output `what`, refused first (ResourceError naming `what`) when
// it and the file image that writing it needs would not fit in the memory available.
template <class T = float>
Tensor<T> allocate_output(const Shape& shape, std::string_view what);

// The files one run writes. Paths are checked when planned, before any work; values are handed
// over once computed; commit() writes them all. A run that throws before commit() returns writes
// nothing, and commit() itself either writes every file or none.
class OutputFiles {
 public:
  // Plans output `arg` at `path`. Throws IoError naming `arg` when the path is empty or "-" (which
  // would look like standard output, where no binary file goes), is a
  // directory, lies in a directory that does not exist or is not writable, or names the same file
  // as an output planned before.
  void plan(std::string_view arg, const std::filesystem::path& path);

  bool empty() const { return files_.empty(); }
  bool planned(std::string_view arg) const;

  // The contents of planned output `arg`: an array, written as a .npy of its dtype, or the bytes of a
  // file (a picture). Contents for an output not planned are dropped, so that callers can hand
  // over everything they computed.
  void set(std::string_view arg, Tensor<float> values);
  void set(std::string_view arg, Tensor<double> values);
  void set(std::string_view arg, std::string bytes);

  // Writes every planned output, all or nothing (qkv::StagedFiles). IoError names the output whose
  // temporary could not be written.
  void commit();

 private:
  struct File {
    std::string arg;
    std::filesystem::path path;
    std::variant<std::monostate, Tensor<float>, Tensor<double>, std::string> contents;
  };
  std::vector<File> files_;
};

// ---- Names and numbers ----------------------------------------------------------------------

// The name of `candidates` that `name` is most likely a typo of (the fewest edits, at most a third
// of the name's length and at least 2), or nothing when none is that close.
std::optional<std::string> closest_name(std::string_view name, const std::vector<std::string>& candidates);

// Why `text` is not a decimal integer from 0 to 2^64 - 1, or "" when it is: a CLI11 check for the
// uint64 options (--seed), whose conversion would wrap -1 and saturate what is too large.
std::string uint64_error(const std::string& text);

// Option `arg`'s "L,R" as an attention window: two integers, each -1 (unbounded) or at least 0.
// Anything else is a ValueError naming `arg` and the text given.
AttentionWindow parse_window(std::string_view text, std::string_view arg);

// ---- The terminal ---------------------------------------------------------------------------

// The colours of a grid printed to standard output with --color `when` (auto, always or never):
// auto colours only what terminal_supports_color(stdout) says a terminal shows, and colours are
// 24-bit where terminal_supports_truecolor() says so, else the nearest of the 256-colour cube.
TerminalColor terminal_color(std::string_view when);

// The columns that text printed to standard output may take: COLUMNS when it is a whole number
// (what a shell exports, and what a user sets to choose), else the terminal's own width when
// standard output is one, else 80 (a pipe or a file, read in an 80-column window more often than
// not). Never below kMinTerminalWidth (qkv/viz/heatmap.hpp), the narrowest a heatmap can fit.
int64_t terminal_width();

// ---- The library's messages -------------------------------------------------------------------

// The library's messages name its arguments as its API spells them (q, k, alibi_slopes, ...); the
// CLI's name the option that gave each (--q, --k, --alibi, ...), with the library's wording kept.
std::string with_option_names(std::string_view message);

// Runs a library call, its refusals renamed by with_option_names.
template <class Call>
void naming_options(Call&& call) {
  try {
    std::forward<Call>(call)();
  } catch (const ShapeError& e) {
    throw ShapeError(with_option_names(e.what()));
  } catch (const ValueError& e) {
    throw ValueError(with_option_names(e.what()));
  }
}

}  // namespace qkv::cli
