// sft_idx.hpp -- independent C++17 reader and validator of megatron_sft_idx shards.
//
// Written from docs/FORMAT.md (format 1.0), not from the Python package: it is a
// second implementation, so a disagreement between the two is a bug in one of
// them or an ambiguity in the spec.
//
//   auto opened = sft_idx::Shard::open("/data/train_000");
//   if (!opened) { log(opened.error().describe()); return; }
//   const sft_idx::Shard& shard = *opened.value();
//   auto pack = shard.pack(17);            // spans into the read-only maps
//   if (pack) use(pack.value().loss_mask.data, pack.value().packed_len);
//
//   sft_idx::Report r = sft_idx::validate("/data/train_000");   // the promotion gate
//   r.verdict == sft_idx::Verdict::pass
//
// Error policy: nothing here prints, asserts or (apart from std::bad_alloc)
// throws; every problem is a returned Error/Finding naming the file, the field,
// what was expected and what was found. A Shard is immutable after open(), so
// any number of threads may read packs from it concurrently. Little-endian hosts
// only (open() refuses others): packs are handed out as native spans.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace sft_idx {

// .seq.idx version this code implements; a file with another major is refused.
inline constexpr int kSupportedMajor = 1;
inline constexpr int kKnownMinor = 2;  // 1.1: pad_layout, stats.min_packed_runtime_len; 1.2: sources

// Megatron's dtype codes (FORMAT.md "Dtype codes").
enum class DType : uint8_t {
  uint8 = 1, int8 = 2, int16 = 3, int32 = 4, int64 = 5, float64 = 6, float32 = 7, uint16 = 8,
};
// Bytes per element, 0 for an unknown code.
size_t itemsize(DType dtype) noexcept;
const char* dtype_name(DType dtype) noexcept;  // "uint16", ... or "unknown"

// Pack invariants, FORMAT.md "Pack invariants"; the codes are stable.
enum class Rule : int {
  OK = 0,
  PACK_EMPTY = 1,
  PACK_TOO_LONG = 2,
  LENGTH_MISMATCH = 3,
  LOSS_VALUE = 4,
  LOSS_ON_LAST = 5,
  SEQ_NONE = 6,
  SEQ_FIRST_NOT_ZERO = 7,
  SEQ_NOT_INCREASING = 8,
  SEQ_START_OUT_OF_RANGE = 9,
  SEQ_NOT_PAD_MULTIPLE = 10,
  TOKEN_NEGATIVE = 11,
  TOKEN_TOO_LARGE = 12,
  TOKEN_OUT_OF_VOCAB = 13,
};
const char* rule_name(Rule rule) noexcept;     // "LOSS_VALUE"
const char* rule_code(Rule rule) noexcept;     // the gate's finding code, "LOSS_NOT_BINARY"
const char* rule_text(Rule rule) noexcept;     // one sentence

// A refusal: which file, which field, what was expected, what was found.
struct Error {
  std::string code;      // stable finding code shared with the Python gate, e.g. "SEQ_IDX_HEADER_CRC"
  std::string file;      // full path of the file concerned (the prefix when about the whole shard)
  std::string field;     // header field / array / metadata key, may be empty
  std::string expected;  // may be empty
  std::string actual;    // may be empty
  std::string message;   // self-contained: what is wrong, with field, expected and found
  int64_t pack = -1;     // pack index, -1 when not about one pack
  // "<file>: [pack <i>: ]<message> [<code>]"
  std::string describe() const;
};

// Either a value or an Error; no exceptions.
template <class T>
class Result {
 public:
  Result(T value) : value_(std::move(value)) {}              // NOLINT(google-explicit-constructor)
  Result(Error error) : error_(std::move(error)) {}          // NOLINT(google-explicit-constructor)
  bool ok() const noexcept { return value_.has_value(); }
  explicit operator bool() const noexcept { return ok(); }
  // Only when ok().
  T& value() & { return *value_; }
  const T& value() const& { return *value_; }
  T&& value() && { return std::move(*value_); }
  // Only when !ok().
  const Error& error() const noexcept { return error_; }

 private:
  std::optional<T> value_;
  Error error_;
};

template <class T>
struct Span {
  const T* data = nullptr;
  size_t size = 0;
  const T& operator[](size_t i) const noexcept { return data[i]; }
  const T* begin() const noexcept { return data; }
  const T* end() const noexcept { return data + size; }
};

// One pack: pointers into the shard's maps, valid while the Shard lives.
struct PackView {
  uint64_t index = 0;
  DType token_dtype = DType::uint16;
  const void* input_ids = nullptr;  // packed_len elements of token_dtype, aligned to its itemsize
  size_t packed_len = 0;
  Span<uint8_t> loss_mask;          // packed_len values, label-aligned 0/1
  Span<int32_t> seq_start_id;       // >= 1 values when the pack is valid
  // Token j widened to int64 (j < packed_len).
  int64_t token(size_t j) const noexcept;
};

struct FileDigest {
  uint64_t size = 0;
  uint64_t crc32 = 0;
};

// The packing statistics the metadata records (FORMAT.md "stats keys").
struct Stats {
  int64_t pack_count = 0, sequence_count = 0, token_count = 0, loss_token_count = 0;
  int64_t max_samples_per_bin = 0, dataset_max_seqlen = 0, min_seqlen = 0;
  int64_t min_packed_seqlen = 0, max_packed_seqlen = 0;
  std::optional<int64_t> min_packed_runtime_len;  // format 1.1; absent in 1.0
  double packing_factor = 0.0;
  std::optional<double> packing_efficiency;  // null without pack_size
};

// The metadata keys this implementation needs; the JSON itself is Shard::metadata_json().
struct Metadata {
  std::optional<int64_t> pack_size;   // null only for spools
  std::string token_dtype;            // "uint16" or "int32"
  std::optional<int64_t> vocab_size;  // every token id < vocab_size when known
  std::string loss_mask_convention;   // "label_aligned"
  int64_t pad_seq_to_mult = 1;
  int64_t pad_offset = 0;             // pad_layout: 0 "stored" (absent in 1.0), 1 "runtime"
  // format 1.2 "sources": each source's recorded sequence count, in order (absent: no sources)
  std::optional<std::vector<int64_t>> source_sequences;
  FileDigest files[4];                // .bin, .idx, .loss.bin, .seq.bin (kChecksummed order)
  Stats stats;
};

// Order of Metadata::files.
inline constexpr const char* kChecksummed[4] = {".bin", ".idx", ".loss.bin", ".seq.bin"};

// Result of checking one pack's invariants: the first rule broken and where.
// position: a token index for LOSS_* and TOKEN_* rules, an index into seq_start_id for SEQ_*.
struct PackCheck {
  Rule rule = Rule::OK;
  int64_t position = -1;
};

// A read-only, memory-mapped SFT shard (five files sharing a prefix).
class Shard {
 public:
  // Maps the five files and checks everything that is cheap: both headers (CRC,
  // version, dtype codes, counts), the metadata, every file size against the
  // headers and the metadata, and that the last pack ends at the end of .bin.
  // It does not walk the arrays: pack() bounds-checks each access instead.
  static Result<std::unique_ptr<Shard>> open(const std::string& prefix);

  ~Shard();
  Shard(const Shard&) = delete;
  Shard& operator=(const Shard&) = delete;

  uint64_t size() const noexcept;            // N, packs
  uint64_t sequence_count() const noexcept;  // S
  uint64_t token_count() const noexcept;     // T
  DType token_dtype() const noexcept;
  int version_minor() const noexcept;
  const std::string& prefix() const noexcept;
  const Metadata& metadata() const noexcept;
  std::string_view metadata_json() const noexcept;

  // Pack i. A corrupt pointer, length or CSR offset gives an Error (code
  // "PACK_OUT_OF_BOUNDS"), an index >= size() one with code "INDEX_OUT_OF_RANGE".
  Result<PackView> pack(uint64_t i) const;
  // The pack invariants (FORMAT.md table) with this shard's pack_size, vocab_size
  // (or vocab_override when > 0) and pad_seq_to_mult.
  PackCheck check_pack(const PackView& pack, int64_t vocab_override = 0) const noexcept;

 private:
  struct Impl;
  explicit Shard(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

enum class Severity { error, warning, info };
const char* severity_name(Severity s) noexcept;

// One problem (or notice) found by validate().
struct Finding {
  std::string code;        // stable code (the Python gate's names, docs/GATE.md)
  Rule rule = Rule::OK;    // the pack invariant, for pack findings
  Severity severity = Severity::error;
  std::string file;        // full path (the prefix when about the whole shard)
  int64_t pack = -1;
  int64_t offset = -1;     // byte offset in `file`, -1 when none
  std::string field;       // may be empty
  std::string expected;    // may be empty
  std::string actual;      // may be empty
  std::string message;     // self-contained: what is wrong, with field, expected and found
};

struct ValidateOptions {
  bool checksums = true;               // CRC-32 of .bin/.idx/.loss.bin/.seq.bin vs the metadata
  std::optional<int64_t> vocab_size;   // overrides the metadata's vocab_size
  size_t max_findings = 200;           // findings kept; the rest are only counted
};

enum class Verdict { pass = 0, fail = 1, unreadable = 2 };

struct Report {
  std::string prefix;
  Verdict verdict = Verdict::pass;
  std::vector<Finding> findings;  // at most max_findings
  uint64_t total_findings = 0;    // including those beyond the cap
  uint64_t errors = 0;            // error-severity findings, including those beyond the cap
};

// Every check of FORMAT.md on one shard: presence, both headers, metadata,
// padding, body CRC, cross-file sizes and counts, the four data files' CRC-32,
// the .idx pointer chain and document indices, the CSR offsets, every pack
// invariant and the recorded statistics. Carries on past a finding where the
// bytes allow, so one run reports everything. Verdict: unreadable when a file
// cannot be opened/mapped (or no file exists at the prefix), fail on any error.
Report validate(const std::string& prefix, const ValidateOptions& options = {});

}  // namespace sft_idx
