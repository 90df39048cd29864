// sft_idx_internal.hpp -- the layout constants of docs/FORMAT.md and the pieces the
// reader (sft_idx.cpp) and the validator (sft_idx_validate.cpp) share. Not installed.
#pragma once

#include <cstdint>
#include <climits>
#include <cstring>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "sft_idx.hpp"

namespace sft_idx {
namespace detail {

// ---------------------------------------------------------------- layout (FORMAT.md)

enum FileId { kBin = 0, kIdx = 1, kLoss = 2, kSeqIdx = 3, kSeqBin = 4, kFileCount = 5 };
inline constexpr const char* kSuffix[kFileCount] = {".bin", ".idx", ".loss.bin", ".seq.idx", ".seq.bin"};
// Metadata::files order -> FileId.
inline constexpr FileId kChecksummedIds[4] = {kBin, kIdx, kLoss, kSeqBin};

// P.idx, upstream MMIDIDX v1.
inline constexpr char kIdxMagic[9] = {'M', 'M', 'I', 'D', 'I', 'D', 'X', '\0', '\0'};
inline constexpr uint64_t kIdxVersion = 1;
inline constexpr size_t kIdxOffVersion = 9, kIdxOffDtype = 17, kIdxOffSeqCount = 18, kIdxOffDocCount = 26;
inline constexpr size_t kIdxHeaderSize = 34;

// P.seq.idx, version 1.x.
inline constexpr char kSeqIdxMagic[8] = {'M', 'S', 'F', 'T', 'S', 'E', 'Q', '\0'};
inline constexpr size_t kSeqOffMajor = 8, kSeqOffMinor = 10, kSeqOffTokenDtype = 12, kSeqOffSeqDtype = 13,
                        kSeqOffLossDtype = 14, kSeqOffFlags = 15, kSeqOffPackCount = 16,
                        kSeqOffSeqCount = 24, kSeqOffTokenCount = 32, kSeqOffMetaLen = 40,
                        kSeqOffCsr = 48, kSeqOffBodyCrc = 56, kSeqOffHeaderCrc = 60;
inline constexpr size_t kSeqIdxHeaderSize = 64;
// flags (1.2): bit 0, a uint16 source id per sequence after the CSR offsets; other bits reserved.
inline constexpr uint8_t kFlagSources = 0x01, kKnownFlags = kFlagSources;
inline constexpr int kSourcesMinor = 2;
inline constexpr uint64_t kMaxSources = 65535;
inline constexpr size_t kMetadataOffset = 64;
inline constexpr uint64_t kAlignment = 64;

// FORMAT.md "Limits" (format.py holds the same numbers; tests/core/test_limits.py checks both agree).
inline constexpr uint64_t kMaxMetadataLength = uint64_t{16} << 20;
inline constexpr uint64_t kMaxMetadataDepth = 64;   // containers nested; the top-level object is 1
inline constexpr uint64_t kMaxCount = uint64_t{1} << 56;  // pack/sequence/token counts of .seq.idx
// Opening one generation of a shard that is being replaced (FORMAT.md "Publication"):
// attempts, and the first pause in microseconds (doubled up to kOpenMaxPauseUs).
inline constexpr int kOpenAttempts = 12;
inline constexpr unsigned kOpenFirstPauseUs = 1000, kOpenMaxPauseUs = 50000;
struct IntRange {
  int64_t min, max;
};
inline constexpr IntRange kPackSizeRange = {1, INT32_MAX};
inline constexpr IntRange kVocabSizeRange = {1, INT32_MAX};
inline constexpr IntRange kPadRange = {1, INT32_MAX};
inline constexpr IntRange kStatRange = {0, INT64_MAX};
inline constexpr IntRange kFileSizeRange = {0, INT64_MAX};
inline constexpr IntRange kCrcRange = {0, INT64_C(0xFFFFFFFF)};
inline constexpr IntRange kSetCountRange = {1, INT32_MAX};
inline constexpr IntRange kSetIndexRange = {0, INT32_MAX - 1};
inline constexpr uint64_t kMaxSetText = 256;  // bytes of set.id / set.name

// ---------------------------------------------------------------- little-endian loads

// Byte-wise assembly: correct on any alignment and host; GCC/Clang fold it to one load.
inline uint16_t le16(const uint8_t* p) noexcept { return uint16_t(p[0] | (p[1] << 8)); }
inline uint32_t le32(const uint8_t* p) noexcept {
  return uint32_t(p[0]) | uint32_t(p[1]) << 8 | uint32_t(p[2]) << 16 | uint32_t(p[3]) << 24;
}
inline uint64_t le64(const uint8_t* p) noexcept { return uint64_t(le32(p)) | uint64_t(le32(p + 4)) << 32; }
inline int32_t le_i32(const uint8_t* p) noexcept {
  uint32_t u = le32(p);
  int32_t v;
  std::memcpy(&v, &u, sizeof v);
  return v;
}
inline int64_t le_i64(const uint8_t* p) noexcept {
  uint64_t u = le64(p);
  int64_t v;
  std::memcpy(&v, &u, sizeof v);
  return v;
}

// ---------------------------------------------------------------- checked arithmetic

inline bool mul_ok(uint64_t a, uint64_t b, uint64_t* out) noexcept { return !__builtin_mul_overflow(a, b, out); }
inline bool add_ok(uint64_t a, uint64_t b, uint64_t* out) noexcept { return !__builtin_add_overflow(a, b, out); }
// a + b*c without overflow.
inline bool madd_ok(uint64_t a, uint64_t b, uint64_t c, uint64_t* out) noexcept {
  uint64_t t;
  return mul_ok(b, c, &t) && add_ok(a, t, out);
}

// ---------------------------------------------------------------- a read-only map of one file

class MappedFile {
 public:
  MappedFile() = default;
  ~MappedFile();
  MappedFile(MappedFile&& other) noexcept;
  MappedFile& operator=(MappedFile&& other) noexcept;
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  // Maps `path` read-only (an empty file gives data() == nullptr, size() == 0).
  // `populate` pre-faults the whole file (for a pass that reads all of it).
  // On failure returns false and sets *why (strerror or "not a regular file").
  bool map(const std::string& path, bool populate, std::string* why);
  const uint8_t* data() const noexcept { return data_; }
  uint64_t size() const noexcept { return size_; }
  // Identity of the mapped file (st_dev, st_ino), and errno of the last failed map().
  uint64_t dev() const noexcept { return dev_; }
  uint64_t ino() const noexcept { return ino_; }
  int error() const noexcept { return errno_; }

 private:
  const uint8_t* data_ = nullptr;
  uint64_t size_ = 0;
  void* base_ = nullptr;
  uint64_t dev_ = 0, ino_ = 0;
  int errno_ = 0;
};

// ---------------------------------------------------------------- parsed headers

struct IdxHeader {
  uint8_t dtype_code = 0;
  uint64_t sequence_count = 0;  // N
  uint64_t document_count = 0;  // D
  uint64_t lengths_offset() const noexcept { return kIdxHeaderSize; }
  uint64_t pointers_offset() const noexcept { return kIdxHeaderSize + 4 * sequence_count; }
  uint64_t documents_offset() const noexcept { return kIdxHeaderSize + 12 * sequence_count; }
};

struct SeqIdxHeader {
  uint16_t version_major = 0, version_minor = 0;
  uint8_t token_dtype_code = 0, seq_dtype_code = 0, loss_dtype_code = 0, flags = 0;
  uint64_t pack_count = 0, sequence_count = 0, token_count = 0, metadata_length = 0, csr_offset = 0;
  uint32_t body_crc32 = 0, header_crc32 = 0;
  bool has_sources() const noexcept { return (flags & kFlagSources) != 0; }
  uint64_t csr_end() const noexcept { return csr_offset + 8 * (pack_count + 1); }  // fields checked first
  uint64_t sources_offset() const noexcept { return (csr_end() + 63) / 64 * 64; }
};

// ---------------------------------------------------------------- findings

// Collects findings up to a cap, counting all of them.
class Sink {
 public:
  explicit Sink(size_t cap) : cap_(cap) {}
  void add(Finding f);
  const std::vector<Finding>& findings() const noexcept { return findings_; }
  std::vector<Finding>& findings() noexcept { return findings_; }
  uint64_t total() const noexcept { return total_; }
  uint64_t errors() const noexcept { return errors_; }
  bool unreadable = false;  // a file could not be opened or mapped, or nothing is at the prefix

 private:
  size_t cap_;
  std::vector<Finding> findings_;
  uint64_t total_ = 0, errors_ = 0;
};

// "<message> (field F: expected E, found A)"
std::string detail_text(std::string_view message, std::string_view field, std::string_view expected,
                        std::string_view actual);

// Everything known about one shard while it is checked.
struct Context {
  std::string prefix;
  std::string path[kFileCount];
  bool present[kFileCount] = {};
  uint64_t stat_size[kFileCount] = {};
  MappedFile file[kFileCount];

  std::optional<IdxHeader> idx;     // fields readable (maybe with a size finding)
  bool idx_arrays_ok = false;       // header valid and file size exact: arrays may be read
  std::optional<SeqIdxHeader> seq;  // fields readable
  bool csr_ok = false;              // header valid and file size exact: CSR (and source ids) may be read
  std::optional<Metadata> meta;
  std::string_view metadata_json;
  bool sizes_ok = false;            // every cross-file count and size agrees
  bool pointers_ok = false;         // pointer chain exact, ends at the end of .bin, documents 0..N
  bool offsets_ok = false;          // CSR offsets exact

  const MappedFile& f(FileId id) const noexcept { return file[id]; }
};

// ---- structural passes shared by Shard::open and validate() (sft_idx.cpp)
// Stats and maps the five files. False when nothing more can be checked.
// `populate`: the caller will read every byte (validate), so pre-fault the maps.
bool locate_and_map(Context& ctx, Sink& sink, bool populate);
void check_idx_header(Context& ctx, Sink& sink);
// Header, metadata, padding; the body CRC only with `body_crc`.
void check_seq_idx_header(Context& ctx, Sink& sink, bool body_crc);
void cross_check(Context& ctx, Sink& sink);

// ---- metadata (sft_idx_json.cpp)
// Strict UTF-8 + RFC 8259 JSON, then the required keys of FORMAT.md "Metadata".
// Adds METADATA_UNPARSABLE / METADATA_INVALID findings; nullopt when either fired.
std::optional<Metadata> parse_metadata(std::string_view json, const std::string& path, Sink& sink);

// ---- pack invariants (sft_idx_validate.cpp)
struct PackLimits {
  int64_t pack_size = 0;   // 0 = unknown
  int64_t vocab_size = 0;  // 0 = unknown
  int64_t pad_mult = 1;
  int64_t pad_offset = 0;  // 1 for pad_layout "runtime": (length - 1) % pad_mult == 0
  int64_t dtype_max = 0;
};
struct PackStats {  // of one valid pack
  int64_t max_seqlen = 0, min_seqlen = 0, loss_sum = 0;
};
PackCheck check_pack_raw(DType dtype, const void* ids, const uint8_t* loss, size_t n, const int32_t* starts,
                         size_t n_starts, const PackLimits& limits, PackStats* stats) noexcept;
int64_t dtype_max(DType dtype) noexcept;

std::string to_str(uint64_t v);
std::string to_str_i(int64_t v);
// field / expected / actual of a finding (any may be empty).
struct Detail {
  std::string field, expected, actual;
};
// file_id -1: about the whole shard (file = prefix).
Finding make_finding(std::string code, const Context& ctx, int file_id, std::string_view what,
                     Detail detail = {}, int64_t offset = -1, int64_t pack = -1,
                     Severity severity = Severity::error);
// A value the file holds against the one a record holds (a CRC, a size, a statistic), in the
// Python gate's words: `message` says both ("CRC-32 is F, the metadata records R"); the finding's
// expected is the recorded value and actual the one found, as everywhere else in a report.
Finding make_recorded_finding(std::string code, const Context& ctx, int file_id, std::string message,
                              std::string field, std::string recorded, std::string found, int64_t offset = -1);
// "0x0000abcd", as Python's f"{v:#010x}".
std::string hex32(uint32_t v);
uint32_t crc32_bytes(const uint8_t* data, uint64_t size) noexcept;

}  // namespace detail
}  // namespace sft_idx
