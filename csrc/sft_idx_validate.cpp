// sft_idx_validate.cpp -- validate(): the structural passes, then the data files'
// CRC-32, the .idx arrays, the CSR offsets, every pack invariant and the recorded
// statistics. Each array pass runs only when the passes before it proved that its
// reads stay inside the maps.
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstdint>
#include <string>

#include "sft_idx_internal.hpp"

namespace sft_idx {
namespace detail {

// ---------------------------------------------------------------- one pack

int64_t dtype_max(DType dtype) noexcept {
  switch (dtype) {
    case DType::uint8: return 255;
    case DType::int8: return 127;
    case DType::int16: return 32767;
    case DType::uint16: return 65535;
    case DType::int32: return INT32_MAX;
    default: return INT64_MAX;
  }
}

namespace {

// The three whole-pack loops below are the validator's hot path. Baseline x86-64
// (SSE2) has no packed min/max for uint16/int32, so they are also compiled for
// AVX2 and picked at load time (GCC ifunc); elsewhere they build as usual.
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && !defined(__SANITIZE_ADDRESS__)
#define SFT_IDX_HOT __attribute__((target_clones("avx2", "default"), optimize("tree-vectorize")))
#else
#define SFT_IDX_HOT
#endif

SFT_IDX_HOT void minmax_u16(const uint16_t* ids, size_t n, int64_t* lo_out, int64_t* hi_out) noexcept {
  uint16_t lo = n ? ids[0] : 0, hi = lo;
  for (size_t j = 0; j < n; ++j) {
    lo = ids[j] < lo ? ids[j] : lo;
    hi = ids[j] > hi ? ids[j] : hi;
  }
  *lo_out = lo;
  *hi_out = hi;
}

SFT_IDX_HOT void minmax_i32(const int32_t* ids, size_t n, int64_t* lo_out, int64_t* hi_out) noexcept {
  int32_t lo = n ? ids[0] : 0, hi = lo;
  for (size_t j = 0; j < n; ++j) {
    lo = ids[j] < lo ? ids[j] : lo;
    hi = ids[j] > hi ? ids[j] : hi;
  }
  *lo_out = lo;
  *hi_out = hi;
}

template <class T>
PackCheck check_tokens(const T* ids, size_t n, const PackLimits& lim) noexcept {
  const int64_t limit = lim.vocab_size > 0 && lim.vocab_size - 1 < lim.dtype_max ? lim.vocab_size - 1 : lim.dtype_max;
  // Min/max first; locate the culprit only on failure.
  int64_t lo = 0, hi = 0;
  if constexpr (sizeof(T) == 2) minmax_u16(ids, n, &lo, &hi);
  else minmax_i32(ids, n, &lo, &hi);
  if (lo >= 0 && hi <= limit) return {};
  for (size_t j = 0; j < n; ++j) {
    const int64_t v = int64_t(ids[j]);
    if (v < 0) return {Rule::TOKEN_NEGATIVE, int64_t(j)};
    if (v > lim.dtype_max) return {Rule::TOKEN_TOO_LARGE, int64_t(j)};
    if (lim.vocab_size > 0 && v >= lim.vocab_size) return {Rule::TOKEN_OUT_OF_VOCAB, int64_t(j)};
  }
  return {};
}

// OR of all loss values (any value > 1 leaves a bit above bit 0) and their sum.
// n < 2^31, so a uint32 sum cannot overflow.
SFT_IDX_HOT void scan_loss(const uint8_t* loss, size_t n, uint8_t* bits_out, uint32_t* sum_out) noexcept {
  uint8_t bits = 0;
  uint32_t sum = 0;
  for (size_t j = 0; j < n; ++j) {
    bits = uint8_t(bits | loss[j]);
    sum += loss[j];
  }
  *bits_out = bits;
  *sum_out = sum;
}

}  // namespace

// Rules in dependency order: lengths, then sequence starts (rule 5 needs valid
// boundaries), then loss values, then token ids. Reports the first rule broken.
PackCheck check_pack_raw(DType dtype, const void* ids, const uint8_t* loss, size_t n, const int32_t* starts,
                         size_t n_starts, const PackLimits& lim, PackStats* stats) noexcept {
  if (n == 0) return {Rule::PACK_EMPTY, 0};
  if (lim.pack_size > 0 && int64_t(n) > lim.pack_size) return {Rule::PACK_TOO_LONG, int64_t(n)};
  if (n_starts == 0) return {Rule::SEQ_NONE, 0};
  if (starts[0] != 0) return {Rule::SEQ_FIRST_NOT_ZERO, 0};
  int64_t max_len = 0, min_len = int64_t(n);
  for (size_t k = 0; k < n_starts; ++k) {
    const int64_t begin = starts[k];
    int64_t end = int64_t(n);
    if (k + 1 < n_starts) {
      end = starts[k + 1];
      if (end <= begin) return {Rule::SEQ_NOT_INCREASING, int64_t(k + 1)};
      if (end >= int64_t(n)) return {Rule::SEQ_START_OUT_OF_RANGE, int64_t(k + 1)};
    }
    const int64_t len = end - begin;
    if (lim.pad_mult > 1 && (len - lim.pad_offset) % lim.pad_mult != 0) return {Rule::SEQ_NOT_PAD_MULTIPLE, int64_t(k)};
    max_len = len > max_len ? len : max_len;
    min_len = len < min_len ? len : min_len;
  }
  uint8_t bits = 0;
  uint32_t loss_sum = 0;
  scan_loss(loss, n, &bits, &loss_sum);
  if (bits > 1) {
    for (size_t j = 0; j < n; ++j)
      if (loss[j] > 1) return {Rule::LOSS_VALUE, int64_t(j)};
  }
  for (size_t k = 0; k < n_starts; ++k) {  // label-aligned: nothing to predict after a sequence's last token
    const size_t last = size_t((k + 1 < n_starts ? int64_t(starts[k + 1]) : int64_t(n)) - 1);
    if (loss[last] != 0) return {Rule::LOSS_ON_LAST, int64_t(last)};
  }
  const PackCheck tokens = dtype == DType::uint16
                               ? check_tokens(static_cast<const uint16_t*>(ids), n, lim)
                               : check_tokens(static_cast<const int32_t*>(ids), n, lim);
  if (tokens.rule != Rule::OK) return tokens;
  if (stats) *stats = {max_len, min_len, int64_t(loss_sum)};
  return {};
}

namespace {

// ---------------------------------------------------------------- checksums

void check_checksums(const Context& ctx, Sink& sink) {
  for (int k = 0; k < 4; ++k) {
    const FileId id = kChecksummedIds[k];
    const FileDigest& rec = ctx.meta->files[k];
    if (ctx.f(id).size() != rec.size) continue;  // a size finding already says more
    const uint32_t crc = crc32_bytes(ctx.f(id).data(), ctx.f(id).size());
    if (crc != rec.crc32) {
      sink.add(make_recorded_finding("CHECKSUM_MISMATCH", ctx, id, "CRC-32 is " + hex32(crc) +
                                     ", the metadata records " + hex32(uint32_t(rec.crc32)),
                                     std::string("files.") + kSuffix[id] + ".crc32", hex32(uint32_t(rec.crc32)),
                                     hex32(crc)));
    }
  }
}

// ---------------------------------------------------------------- .idx arrays

// document_indices must be exactly 0, 1, ..., N (one document per pack).
bool check_document_indices(const Context& ctx, Sink& sink) {
  const IdxHeader& h = *ctx.idx;
  const uint8_t* p = ctx.f(kIdx).data();
  const uint64_t n = h.sequence_count;
  const uint64_t d = h.document_count;
  bool docs_ok = d > 0;
  for (uint64_t k = 0; k < d && docs_ok; ++k) {
    const int64_t v = le_i64(p + h.documents_offset() + 8 * k);
    if (v != int64_t(k) || (k + 1 == d && k != n)) {
      docs_ok = false;
      sink.add(make_finding("IDX_DOCUMENT_INDICES", ctx, kIdx, "document_indices must be 0, 1, ..., N (one "
                            "document per pack)", {"document_indices[" + to_str(k) + "]",
                            to_str(k + 1 == d && v == int64_t(k) ? n : k), to_str_i(v)},
                            int64_t(h.documents_offset() + 8 * k)));
    }
  }
  if (d == 0) {
    sink.add(make_finding("IDX_DOCUMENT_INDICES", ctx, kIdx, "document_indices is empty",
                          {"document_count", to_str(n + 1), "0"}, int64_t(kIdxOffDocCount)));
  }
  return docs_ok;
}

void check_idx_arrays(Context& ctx, Sink& sink) {
  const IdxHeader& h = *ctx.idx;
  const uint8_t* p = ctx.f(kIdx).data();
  const uint64_t item = itemsize(DType(h.dtype_code));
  const uint64_t n = h.sequence_count;
  uint64_t expected = 0;
  bool chain_ok = true;
  for (uint64_t i = 0; i < n && chain_ok; ++i) {
    const int32_t len = le_i32(p + h.lengths_offset() + 4 * i);
    const int64_t ptr = le_i64(p + h.pointers_offset() + 8 * i);
    if (len <= 0) {
      chain_ok = false;
      sink.add(make_finding("IDX_LENGTH_NONPOSITIVE", ctx, kIdx, "sequence length must be > 0",
                            {"sequence_lengths[" + to_str(i) + "]", "> 0", to_str_i(len)},
                            int64_t(h.lengths_offset() + 4 * i), int64_t(i)));
    } else if (ptr < 0 || uint64_t(ptr) != expected) {
      chain_ok = false;
      const bool wrapped = expected > uint64_t(INT32_MAX) && ptr == int64_t(int32_t(uint32_t(expected)));
      sink.add(make_finding(wrapped ? "IDX_POINTER_INT32_OVERFLOW" : "IDX_POINTER_MISMATCH", ctx, kIdx,
                            wrapped ? "pointer wrapped around at 2 GiB (accumulated in int32)"
                                    : "pointer is not the previous pointer + length * itemsize",
                            {"sequence_pointers[" + to_str(i) + "]", to_str(expected), to_str_i(ptr)},
                            int64_t(h.pointers_offset() + 8 * i), int64_t(i)));
    } else if (!madd_ok(expected, uint64_t(len), item, &expected) || expected > uint64_t(INT64_MAX)) {
      chain_ok = false;
      sink.add(make_finding("IDX_POINTER_MISMATCH", ctx, kIdx, "the running sum of lengths overflows int64",
                            {"sequence_lengths", "", ""}, int64_t(h.lengths_offset() + 4 * i), int64_t(i)));
    }
  }
  if (chain_ok && expected != ctx.f(kBin).size()) {
    chain_ok = false;
    sink.add(make_finding("BIN_SIZE_MISMATCH", ctx, kBin, "the last pack does not end at the end of .bin",
                          {"sequence_pointers[-1] + sequence_lengths[-1] * itemsize", to_str(expected),
                           to_str(ctx.f(kBin).size())}, -1, n ? int64_t(n - 1) : -1));
  }
  const bool docs_ok = check_document_indices(ctx, sink);  // reported even after a chain finding
  ctx.pointers_ok = chain_ok && docs_ok;
}

// ---------------------------------------------------------------- CSR offsets

void check_offsets(Context& ctx, Sink& sink) {
  const SeqIdxHeader& h = *ctx.seq;
  const uint8_t* p = ctx.f(kSeqIdx).data() + h.csr_offset;
  const uint64_t s = h.sequence_count;
  int64_t prev = 0;
  for (uint64_t i = 0; i <= h.pack_count; ++i) {
    const int64_t v = le_i64(p + 8 * i);
    const bool bad = i == 0 ? v != 0 : (v <= prev || uint64_t(v) > s || (i == h.pack_count && uint64_t(v) != s));
    if (bad) {
      std::string want = i == 0 ? "0" : i == h.pack_count ? to_str(s)
                                                          : "in (" + to_str_i(prev) + ", " + to_str(s) + "]";
      sink.add(make_finding("SEQ_IDX_OFFSETS", ctx, kSeqIdx, "CSR seq_offsets must start at 0, increase strictly "
                            "and end at sequence_count", {"seq_offsets[" + to_str(i) + "]", want, to_str_i(v)},
                            int64_t(h.csr_offset + 8 * i), int64_t(i < h.pack_count ? i : h.pack_count - 1)));
      return;
    }
    prev = v;
  }
  ctx.offsets_ok = true;
}

// ---------------------------------------------------------------- source ids (format 1.2)

// Every sequence's source id names a source of the metadata, and each source's recorded
// sequence count is the number of ids naming it.
void check_sources(Context& ctx, Sink& sink) {
  const SeqIdxHeader& h = *ctx.seq;
  if (!h.has_sources() || !ctx.meta || !ctx.meta->source_sequences) return;
  const std::vector<int64_t>& recorded = *ctx.meta->source_sequences;
  const uint8_t* p = ctx.f(kSeqIdx).data() + h.sources_offset();
  std::vector<int64_t> counts(recorded.size(), 0);
  for (uint64_t j = 0; j < h.sequence_count; ++j) {
    const uint16_t id = le16(p + 2 * j);
    if (id >= recorded.size()) {
      sink.add(make_finding("SOURCE_ID_OUT_OF_RANGE", ctx, kSeqIdx, "a sequence's source id names no source of the "
                            "metadata", {"source_ids[" + to_str(j) + "]", "< " + to_str(recorded.size()), to_str(id)},
                            int64_t(h.sources_offset() + 2 * j)));
      return;
    }
    ++counts[id];
  }
  for (size_t k = 0; k < recorded.size(); ++k) {
    if (counts[k] != recorded[k]) {
      sink.add(make_recorded_finding("SOURCES_MISMATCH", ctx, kSeqIdx, "sources[" + to_str(k) + "] records " +
                                     to_str_i(recorded[k]) + " sequences; " + to_str_i(counts[k]) +
                                     " source ids name it", "sources[" + to_str(k) + "].sequences",
                                     to_str_i(recorded[k]), to_str_i(counts[k]), int64_t(kMetadataOffset)));
      return;
    }
  }
}

// ---------------------------------------------------------------- every pack

struct Totals {
  int64_t max_seqlen = 0, min_seqlen = INT64_MAX, loss_sum = 0, max_samples = 0;
  int64_t min_packed = INT64_MAX, max_packed = 0, min_runtime = INT64_MAX;
  uint64_t bad_packs = 0;
};

void pack_finding(const Context& ctx, Sink& sink, uint64_t i, const PackCheck& c, uint64_t t0, uint64_t s0,
                  const PackLimits& lim, int64_t len) {
  const uint64_t item = itemsize(DType(ctx.idx->dtype_code));
  int file = kSeqBin;
  int64_t offset = int64_t((s0 + uint64_t(c.position)) * 4);
  Detail d{"seq_start_id", "", "position " + to_str_i(c.position)};
  switch (c.rule) {
    case Rule::PACK_EMPTY:
    case Rule::PACK_TOO_LONG:
      file = kIdx;
      offset = int64_t(ctx.idx->lengths_offset() + 4 * i);
      d = {"sequence_lengths[" + to_str(i) + "]", lim.pack_size > 0 ? "1.." + to_str_i(lim.pack_size) : "> 0",
           to_str_i(len)};
      break;
    case Rule::LENGTH_MISMATCH:
    case Rule::LOSS_VALUE:
    case Rule::LOSS_ON_LAST:
      file = kLoss;
      offset = int64_t(t0 + uint64_t(c.position));
      d = {"loss_mask[" + to_str_i(c.position) + "]", "0", to_str(ctx.f(kLoss).data()[offset])};
      if (c.rule == Rule::LOSS_VALUE) d.expected = "0 or 1";
      break;
    case Rule::TOKEN_NEGATIVE:
    case Rule::TOKEN_TOO_LARGE:
    case Rule::TOKEN_OUT_OF_VOCAB: {
      file = kBin;
      offset = int64_t((t0 + uint64_t(c.position)) * item);
      const uint8_t* at = ctx.f(kBin).data() + offset;
      const int64_t id = item == 2 ? int64_t(uint16_t(at[0] | at[1] << 8)) : int64_t(le_i32(at));
      d = {"input_ids[" + to_str_i(c.position) + "]",
           lim.vocab_size > 0 ? "0.." + to_str_i(lim.vocab_size - 1) : "0.." + to_str_i(lim.dtype_max), to_str_i(id)};
      break;
    }
    default:
      if (c.rule == Rule::SEQ_NOT_PAD_MULTIPLE) d.expected = std::string(lim.pad_offset ? "sequence lengths minus one" : "sequence lengths") +
                                                      " multiple of " + to_str_i(lim.pad_mult);
      break;
  }
  Finding f = make_finding(rule_code(c.rule), ctx, file, rule_text(c.rule), std::move(d), offset, int64_t(i));
  f.rule = c.rule;
  sink.add(std::move(f));
}

Totals scan_packs(const Context& ctx, Sink& sink, const PackLimits& lim) {
  const IdxHeader& ih = *ctx.idx;
  const DType dtype = DType(ih.dtype_code);
  const uint64_t item = itemsize(dtype);
  const uint8_t* idx = ctx.f(kIdx).data();
  const uint8_t* csr = ctx.f(kSeqIdx).data() + ctx.seq->csr_offset;
  const uint8_t* bin = ctx.f(kBin).data();
  const uint8_t* loss = ctx.f(kLoss).data();
  const auto* starts = reinterpret_cast<const int32_t*>(ctx.f(kSeqBin).data());  // page-aligned map
  Totals t;
  for (uint64_t i = 0; i < ih.sequence_count; ++i) {
    // In bounds: the chain, the CSR and every file size were proved exact before this pass.
    const int64_t len = le_i32(idx + ih.lengths_offset() + 4 * i);
    const uint64_t t0 = uint64_t(le_i64(idx + ih.pointers_offset() + 8 * i)) / item;
    const uint64_t s0 = uint64_t(le_i64(csr + 8 * i)), s1 = uint64_t(le_i64(csr + 8 * (i + 1)));
    PackStats ps;
    const PackCheck c = check_pack_raw(dtype, bin + t0 * item, loss + t0, size_t(len), starts + s0, size_t(s1 - s0),
                                       lim, &ps);
    if (c.rule != Rule::OK) {
      ++t.bad_packs;
      pack_finding(ctx, sink, i, c, t0, s0, lim, len);
      continue;
    }
    t.max_seqlen = ps.max_seqlen > t.max_seqlen ? ps.max_seqlen : t.max_seqlen;
    t.min_seqlen = ps.min_seqlen < t.min_seqlen ? ps.min_seqlen : t.min_seqlen;
    t.loss_sum += ps.loss_sum;
    t.max_samples = int64_t(s1 - s0) > t.max_samples ? int64_t(s1 - s0) : t.max_samples;
    t.min_packed = len < t.min_packed ? len : t.min_packed;
    t.max_packed = len > t.max_packed ? len : t.max_packed;
    const int64_t runtime = len - int64_t(s1 - s0);
    t.min_runtime = runtime < t.min_runtime ? runtime : t.min_runtime;
  }
  return t;
}

// The recorded statistics must be what the data says (Megatron-Bridge's pad_cu_seqlens uses them).
void compare_stats(const Context& ctx, Sink& sink, const Totals& t) {
  const Stats& s = ctx.meta->stats;
  const int64_t n = int64_t(ctx.seq->pack_count), seqs = int64_t(ctx.seq->sequence_count);
  const int64_t toks = int64_t(ctx.seq->token_count);
  const struct { const char* name; int64_t recorded, actual; } ints[] = {
      {"loss_token_count", s.loss_token_count, t.loss_sum}, {"max_samples_per_bin", s.max_samples_per_bin, t.max_samples},
      {"dataset_max_seqlen", s.dataset_max_seqlen, t.max_seqlen}, {"min_seqlen", s.min_seqlen, t.min_seqlen},
      {"min_packed_seqlen", s.min_packed_seqlen, t.min_packed}, {"max_packed_seqlen", s.max_packed_seqlen, t.max_packed}};
  auto mismatch = [&](const std::string& name, const std::string& rec, const std::string& act) {
    sink.add(make_recorded_finding("METADATA_STATS_MISMATCH", ctx, kSeqIdx, "stats." + name + " records " + rec +
                                   ", the data gives " + act, "stats." + name, rec, act, int64_t(kMetadataOffset)));
  };
  for (const auto& f : ints)
    if (f.recorded != f.actual) mismatch(f.name, to_str_i(f.recorded), to_str_i(f.actual));
  if (s.min_packed_runtime_len && *s.min_packed_runtime_len != t.min_runtime)
    mismatch("min_packed_runtime_len", to_str_i(*s.min_packed_runtime_len), to_str_i(t.min_runtime));
  // The ratios are written rounded to 6 decimals: allow that rounding plus float noise.
  const double factor = double(seqs) / double(n);
  if (!(std::fabs(s.packing_factor - factor) <= 1.5e-6))
    mismatch("packing_factor", std::to_string(s.packing_factor), std::to_string(factor));
  const auto& ps = ctx.meta->pack_size;
  if (ps && *ps > 0) {
    const double eff = double(toks) / (double(n) * double(*ps));
    if (!s.packing_efficiency || !(std::fabs(*s.packing_efficiency - eff) <= 1.5e-6))
      mismatch("packing_efficiency", s.packing_efficiency ? std::to_string(*s.packing_efficiency) : "null",
               std::to_string(eff));
  } else if (s.packing_efficiency) {
    mismatch("packing_efficiency", std::to_string(*s.packing_efficiency), "null");
  }
}

}  // namespace
}  // namespace detail

Report validate(const std::string& prefix, const ValidateOptions& options) {
  using namespace detail;
  Report report;
  report.prefix = prefix;
  Sink sink(options.max_findings);
  Context ctx;
  ctx.prefix = prefix;
  auto skip = [&](const char* what, const char* why) {
    sink.add(make_finding("CHECK_SKIPPED", ctx, -1, std::string(what) + " not run: " + why, {}, -1, -1,
                          Severity::info));
  };
  if (locate_and_map(ctx, sink, /*populate=*/true)) {
    check_idx_header(ctx, sink);
    check_seq_idx_header(ctx, sink, true);
    cross_check(ctx, sink);
    if (!options.checksums) {
      sink.add(make_finding("CHECKSUMS_SKIPPED", ctx, -1, "CRC-32 of .bin/.idx/.loss.bin/.seq.bin not verified "
                            "(the .seq.idx header and body CRCs were)", {}, -1, -1, Severity::info));
    } else if (!ctx.meta) {
      sink.add(make_finding("CHECKSUMS_SKIPPED", ctx, -1, "no readable metadata to compare CRC-32s with", {}, -1, -1,
                            Severity::info));
    } else {
      check_checksums(ctx, sink);
    }
    if (ctx.idx_arrays_ok) check_idx_arrays(ctx, sink);
    else skip("pointer/length pass", "the .idx header or size is wrong");
    if (ctx.csr_ok) {
      check_offsets(ctx, sink);
      check_sources(ctx, sink);
    } else {
      skip("CSR offsets pass", "the .seq.idx header or size is wrong");
    }
    if (ctx.pointers_ok && ctx.offsets_ok && ctx.sizes_ok) {
      PackLimits lim;
      const DType dtype = DType(ctx.idx->dtype_code);
      lim.dtype_max = dtype_max(dtype);
      if (ctx.meta) {
        lim.pack_size = ctx.meta->pack_size.value_or(0);
        lim.vocab_size = ctx.meta->vocab_size.value_or(0);
        lim.pad_mult = ctx.meta->pad_seq_to_mult;
        lim.pad_offset = ctx.meta->pad_offset;
      }
      if (options.vocab_size && *options.vocab_size > 0) lim.vocab_size = *options.vocab_size;
      const Totals t = scan_packs(ctx, sink, lim);
      if (t.bad_packs == 0 && ctx.meta) compare_stats(ctx, sink, t);
    } else {
      skip("pack scan", "an earlier structural finding makes the arrays untrustworthy");
    }
  }
  report.total_findings = sink.total();
  report.errors = sink.errors();
  report.findings = std::move(sink.findings());
  report.verdict = sink.unreadable ? Verdict::unreadable : sink.errors() ? Verdict::fail : Verdict::pass;
  return report;
}

}  // namespace sft_idx
