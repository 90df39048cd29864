// sft_idx.cpp -- names, errors, the read-only maps, and the Shard reader.
#include "sft_idx.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <cerrno>
#include <cstring>
#include <string>

#include "sft_idx_internal.hpp"

namespace sft_idx {

// ---------------------------------------------------------------- names

size_t itemsize(DType dtype) noexcept {
  switch (dtype) {
    case DType::uint8: case DType::int8: return 1;
    case DType::int16: case DType::uint16: return 2;
    case DType::int32: case DType::float32: return 4;
    case DType::int64: case DType::float64: return 8;
  }
  return 0;
}

const char* dtype_name(DType dtype) noexcept {
  switch (dtype) {
    case DType::uint8: return "uint8";
    case DType::int8: return "int8";
    case DType::int16: return "int16";
    case DType::int32: return "int32";
    case DType::int64: return "int64";
    case DType::float64: return "float64";
    case DType::float32: return "float32";
    case DType::uint16: return "uint16";
  }
  return "unknown";
}

namespace {
struct RuleInfo { const char* name; const char* code; const char* text; };
constexpr RuleInfo kRules[] = {
    {"OK", "OK", "ok"},
    {"PACK_EMPTY", "PACK_EMPTY", "a pack must hold at least one token (0 < packed_len)"},
    {"PACK_TOO_LONG", "PACK_TOO_LONG", "packed_len must not exceed pack_size"},
    {"LENGTH_MISMATCH", "LOSS_LENGTH_MISMATCH", "loss_mask must have exactly one value per token of input_ids"},
    {"LOSS_VALUE", "LOSS_NOT_BINARY", "loss_mask values must be 0 or 1"},
    {"LOSS_ON_LAST", "LOSS_ON_LAST_POSITION", "label-aligned loss mask: the last position of every sequence "
                                              "must be 0 (there is no next token to predict)"},
    {"SEQ_NONE", "SEQ_NONE", "seq_start_id must hold at least one start"},
    {"SEQ_FIRST_NOT_ZERO", "SEQ_FIRST_NOT_ZERO", "seq_start_id[0] must be 0"},
    {"SEQ_NOT_INCREASING", "SEQ_NOT_INCREASING", "seq_start_id must be strictly increasing"},
    {"SEQ_START_OUT_OF_RANGE", "SEQ_START_OUT_OF_RANGE", "every seq_start_id must be < packed_len"},
    {"SEQ_NOT_PAD_MULTIPLE", "SEQ_NOT_PAD_MULTIPLE", "every sequence length (pad_layout stored), or length minus one (runtime), must be a multiple of pad_seq_to_mult"},
    {"TOKEN_NEGATIVE", "TOKEN_NEGATIVE", "token ids must be >= 0"},
    {"TOKEN_TOO_LARGE", "TOKEN_TOO_LARGE", "token id does not fit the shard's token dtype"},
    {"TOKEN_OUT_OF_VOCAB", "TOKEN_OUT_OF_VOCAB", "token id must be < vocab_size"},
};
const RuleInfo& info(Rule r) {
  const int k = int(r);
  return kRules[k >= 0 && k <= 13 ? k : 0];
}
}  // namespace

const char* rule_name(Rule rule) noexcept { return info(rule).name; }
const char* rule_code(Rule rule) noexcept { return info(rule).code; }
const char* rule_text(Rule rule) noexcept { return info(rule).text; }

const char* severity_name(Severity s) noexcept {
  return s == Severity::error ? "error" : s == Severity::warning ? "warning" : "info";
}

std::string Error::describe() const {
  std::string out = file + ": ";
  if (pack >= 0) out += "pack " + std::to_string(pack) + ": ";
  return out + message + " [" + code + "]";
}

int64_t PackView::token(size_t j) const noexcept {
  if (token_dtype == DType::uint16) return static_cast<const uint16_t*>(input_ids)[j];
  return static_cast<const int32_t*>(input_ids)[j];
}

namespace detail {

// ---------------------------------------------------------------- helpers

std::string to_str(uint64_t v) { return std::to_string(v); }
std::string hex32(uint32_t v) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "0x%08x", v);
  return buf;
}
std::string to_str_i(int64_t v) { return std::to_string(v); }

std::string detail_text(std::string_view message, std::string_view field, std::string_view expected,
                        std::string_view actual) {
  std::string out(message);
  if (field.empty() && expected.empty() && actual.empty()) return out;
  out += " (";
  if (!field.empty()) out += "field " + std::string(field);
  if (!expected.empty()) out += (field.empty() ? "" : ": ") + std::string("expected ") + std::string(expected);
  if (!actual.empty()) out += (field.empty() && expected.empty() ? "" : ", ") + std::string("found ") + std::string(actual);
  return out + ")";
}

Finding make_recorded_finding(std::string code, const Context& ctx, int file_id, std::string message,
                              std::string field, std::string recorded, std::string found, int64_t offset) {
  Finding f = make_finding(std::move(code), ctx, file_id, message, {}, offset);
  f.field = std::move(field);
  f.expected = std::move(recorded);
  f.actual = std::move(found);
  return f;
}

Finding make_finding(std::string code, const Context& ctx, int file_id, std::string_view what, Detail detail,
                     int64_t offset, int64_t pack, Severity severity) {
  Finding f;
  f.code = std::move(code);
  f.severity = severity;
  f.file = file_id >= 0 ? ctx.path[file_id] : ctx.prefix;
  f.pack = pack;
  f.offset = offset;
  f.message = detail_text(what, detail.field, detail.expected, detail.actual);
  f.field = std::move(detail.field);
  f.expected = std::move(detail.expected);
  f.actual = std::move(detail.actual);
  return f;
}

void Sink::add(Finding f) {
  ++total_;
  if (f.severity == Severity::error) ++errors_;
  if (findings_.size() < cap_) findings_.push_back(std::move(f));
}

uint32_t crc32_bytes(const uint8_t* data, uint64_t size) noexcept {
  uLong crc = ::crc32(0L, Z_NULL, 0);
  while (size > 0) {  // zlib takes uInt lengths
    const uInt chunk = size > (uint64_t{1} << 30) ? uInt(1) << 30 : uInt(size);
    crc = ::crc32(crc, data, chunk);
    data += chunk;
    size -= chunk;
  }
  return uint32_t(crc);
}

// ---------------------------------------------------------------- MappedFile

MappedFile::~MappedFile() {
  if (base_ != nullptr) ::munmap(base_, size_t(size_));
}

MappedFile::MappedFile(MappedFile&& other) noexcept
    : data_(other.data_), size_(other.size_), base_(other.base_) {
  other.data_ = nullptr;
  other.base_ = nullptr;
  other.size_ = 0;
}

MappedFile& MappedFile::operator=(MappedFile&& other) noexcept {
  if (this != &other) {
    if (base_ != nullptr) ::munmap(base_, size_t(size_));
    data_ = other.data_;
    size_ = other.size_;
    base_ = other.base_;
    other.data_ = nullptr;
    other.base_ = nullptr;
    other.size_ = 0;
  }
  return *this;
}

bool MappedFile::map(const std::string& path, bool populate, std::string* why) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    errno_ = errno;
    *why = std::strerror(errno);
    return false;
  }
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    errno_ = errno;
    *why = std::strerror(errno);
    ::close(fd);
    return false;
  }
  if (!S_ISREG(st.st_mode)) {
    errno_ = EINVAL;
    *why = "not a regular file";
    ::close(fd);
    return false;
  }
  dev_ = uint64_t(st.st_dev);
  ino_ = uint64_t(st.st_ino);
  size_ = uint64_t(st.st_size);
  if (size_ > 0) {
    // Pre-faulting in the kernel costs far less than one page fault per 4 KiB on a full pass.
    void* base = ::mmap(nullptr, size_t(size_), PROT_READ, MAP_SHARED | (populate ? MAP_POPULATE : 0), fd, 0);
    if (base == MAP_FAILED) {
      errno_ = errno;
      *why = std::strerror(errno);
      size_ = 0;
      ::close(fd);
      return false;
    }
    base_ = base;
    data_ = static_cast<const uint8_t*>(base);
  }
  ::close(fd);  // the mapping keeps the file alive
  return true;
}

}  // namespace detail

// ---------------------------------------------------------------- Shard

struct Shard::Impl {
  detail::Context ctx;
  detail::IdxHeader idx;
  detail::SeqIdxHeader seq;
  Metadata meta;
  DType dtype = DType::uint16;
  uint64_t item = 2;
};

Shard::Shard(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Shard::~Shard() = default;

namespace {

bool little_endian_host() {
  const uint16_t one = 1;
  uint8_t first;
  std::memcpy(&first, &one, 1);
  return first == 1;
}

// The last pack must end exactly at the end of .bin (two index entries; the reader
// does not walk the whole chain).
void check_last_pack_end(const detail::Context& ctx, detail::Sink& sink) {
  using namespace detail;
  const IdxHeader& h = *ctx.idx;
  const uint64_t n = h.sequence_count;
  const uint8_t* p = ctx.f(kIdx).data();
  const int64_t len = le_i32(p + h.lengths_offset() + 4 * (n - 1));
  const int64_t ptr = le_i64(p + h.pointers_offset() + 8 * (n - 1));
  uint64_t end = 0;
  const bool fits = len > 0 && ptr >= 0 && madd_ok(uint64_t(ptr), uint64_t(len), itemsize(DType(h.dtype_code)), &end);
  if (!fits || end != ctx.f(kBin).size()) {
    sink.add(make_finding("BIN_SIZE_MISMATCH", ctx, kBin, "the last pack does not end at the end of .bin",
                          {"sequence_pointers[-1] + sequence_lengths[-1] * itemsize",
                           to_str(ctx.f(kBin).size()), fits ? to_str(end) : "an invalid pointer/length"},
                          -1, int64_t(n - 1)));
  }
}

Error to_error(const Finding& f) {
  Error e;
  e.code = f.code;
  e.file = f.file;
  e.field = f.field;
  e.expected = f.expected;
  e.actual = f.actual;
  e.message = f.message;
  e.pack = f.pack;
  return e;
}

}  // namespace

Result<std::unique_ptr<Shard>> Shard::open(const std::string& prefix) {
  using namespace detail;
  if (!little_endian_host()) {
    Error e;
    e.code = "UNSUPPORTED_HOST";
    e.file = prefix;
    e.message = "this reader supports little-endian hosts only (it hands out native spans)";
    return e;
  }
  auto impl = std::make_unique<Impl>();
  Context& ctx = impl->ctx;
  ctx.prefix = prefix;
  Sink sink(16);
  if (locate_and_map(ctx, sink, /*populate=*/false)) {
    check_idx_header(ctx, sink);
    check_seq_idx_header(ctx, sink, /*body_crc=*/false);  // O(file); the gate checks it
    cross_check(ctx, sink);
    if (sink.errors() == 0 && ctx.idx_arrays_ok) check_last_pack_end(ctx, sink);
  }
  for (const Finding& f : sink.findings())
    if (f.severity == Severity::error) return to_error(f);
  if (sink.errors() || !ctx.idx || !ctx.seq || !ctx.meta || !ctx.sizes_ok) {  // defensive: a pass said nothing
    Error e;
    e.code = "SHARD_REFUSED";
    e.file = prefix;
    e.message = "the shard's headers or sizes are inconsistent";
    return e;
  }
  impl->idx = *ctx.idx;
  impl->seq = *ctx.seq;
  impl->meta = *ctx.meta;
  impl->dtype = DType(ctx.idx->dtype_code);
  impl->item = itemsize(impl->dtype);
  return std::unique_ptr<Shard>(new Shard(std::move(impl)));
}

uint64_t Shard::size() const noexcept { return impl_->idx.sequence_count; }
uint64_t Shard::sequence_count() const noexcept { return impl_->seq.sequence_count; }
uint64_t Shard::token_count() const noexcept { return impl_->seq.token_count; }
DType Shard::token_dtype() const noexcept { return impl_->dtype; }
int Shard::version_minor() const noexcept { return impl_->seq.version_minor; }
const std::string& Shard::prefix() const noexcept { return impl_->ctx.prefix; }
const Metadata& Shard::metadata() const noexcept { return impl_->meta; }
std::string_view Shard::metadata_json() const noexcept { return impl_->ctx.metadata_json; }

Result<PackView> Shard::pack(uint64_t i) const {
  using namespace detail;
  const Impl& m = *impl_;
  const Context& ctx = m.ctx;
  auto refuse = [&](const char* code, int file, std::string what, Detail d) -> Result<PackView> {
    Finding f = make_finding(code, ctx, file, what, std::move(d), -1, int64_t(i));
    Error e = to_error(f);
    e.message += "; run sft_idx_check on this shard and rebuild it";
    return e;
  };
  const uint64_t n = m.idx.sequence_count;
  if (i >= n) return refuse("INDEX_OUT_OF_RANGE", -1, "pack index out of range", {"index", "< " + to_str(n), to_str(i)});
  // Untrusted numbers (open() did not walk the arrays): bound every one before use.
  const uint8_t* idx = ctx.f(kIdx).data();
  const int64_t len = le_i32(idx + m.idx.lengths_offset() + 4 * i);
  const int64_t ptr = le_i64(idx + m.idx.pointers_offset() + 8 * i);
  const uint64_t tokens = ctx.f(kBin).size() / m.item;  // == T, == size of .loss.bin (checked at open)
  if (len <= 0 || ptr < 0 || uint64_t(ptr) % m.item != 0 || uint64_t(ptr) / m.item > tokens ||
      uint64_t(len) > tokens - uint64_t(ptr) / m.item) {
    return refuse("PACK_OUT_OF_BOUNDS", kIdx, "pointer/length fall outside .bin",
                  {"sequence_pointers/sequence_lengths", "inside " + to_str(tokens) + " tokens",
                   "pointer " + to_str_i(ptr) + ", length " + to_str_i(len)});
  }
  const uint8_t* csr = ctx.f(kSeqIdx).data() + m.seq.csr_offset;
  const int64_t s0 = le_i64(csr + 8 * i), s1 = le_i64(csr + 8 * (i + 1));
  const uint64_t starts = ctx.f(kSeqBin).size() / 4;  // == S (checked at open)
  if (s0 < 0 || s1 <= s0 || uint64_t(s1) > starts) {
    return refuse("PACK_OUT_OF_BOUNDS", kSeqIdx, "CSR offsets are not increasing within .seq.bin",
                  {"seq_offsets[" + to_str(i) + ".." + to_str(i + 1) + "]", "0 <= start < end <= " + to_str(starts),
                   to_str_i(s0) + ", " + to_str_i(s1)});
  }
  const uint64_t first = uint64_t(ptr) / m.item;
  PackView v;
  v.index = i;
  v.token_dtype = m.dtype;
  v.input_ids = ctx.f(kBin).data() + uint64_t(ptr);  // the map is page-aligned and ptr % itemsize == 0
  v.packed_len = size_t(len);
  v.loss_mask = {ctx.f(kLoss).data() + first, size_t(len)};
  v.seq_start_id = {reinterpret_cast<const int32_t*>(ctx.f(kSeqBin).data()) + s0, size_t(s1 - s0)};
  return v;
}

PackCheck Shard::check_pack(const PackView& pack, int64_t vocab_override) const noexcept {
  detail::PackLimits lim;
  lim.pack_size = impl_->meta.pack_size.value_or(0);
  lim.vocab_size = vocab_override > 0 ? vocab_override : impl_->meta.vocab_size.value_or(0);
  lim.pad_mult = impl_->meta.pad_seq_to_mult;
  lim.pad_offset = impl_->meta.pad_offset;
  lim.dtype_max = detail::dtype_max(pack.token_dtype);
  return detail::check_pack_raw(pack.token_dtype, pack.input_ids, pack.loss_mask.data, pack.packed_len,
                                pack.seq_start_id.data, pack.seq_start_id.size, lim, nullptr);
}

}  // namespace sft_idx
