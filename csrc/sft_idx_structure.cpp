// sft_idx_structure.cpp -- the structural passes shared by Shard::open and validate():
// which files exist, the two headers, the metadata, and every size that must agree.
// Each pass carries on past a finding where the bytes allow (a header whose only
// fault is its CRC or the file's size is still read for its fields).
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <string>

#include "sft_idx_internal.hpp"

namespace sft_idx {
namespace detail {
namespace {

uint64_t align64(uint64_t n) { return (n + kAlignment - 1) / kAlignment * kAlignment; }

bool is_token_code(uint8_t code) { return code == uint8_t(DType::uint16) || code == uint8_t(DType::int32); }

}  // namespace

// ---------------------------------------------------------------- presence and maps

namespace {

enum class Located { kOk, kRetry, kDone };

// Which of the five files exist (FILE_UNREADABLE for other stat errors).
Located stat_files(Context& ctx, Sink& sink) {
  for (int id = 0; id < kFileCount; ++id) {
    ctx.path[id] = ctx.prefix + kSuffix[id];
    struct stat st;
    ctx.present[id] = ::stat(ctx.path[id].c_str(), &st) == 0;
    if (ctx.present[id]) {
      ctx.stat_size[id] = uint64_t(st.st_size);
    } else if (errno != ENOENT && errno != ENOTDIR) {
      sink.unreadable = true;
      sink.add(make_finding("FILE_UNREADABLE", ctx, id, std::string("cannot stat: ") + std::strerror(errno)));
    }
  }
  return sink.unreadable ? Located::kDone : Located::kOk;
}

// Maps one generation: .idx first, then the others, then the path .idx must still name the
// mapped inode -- if it does, no replacement touched a companion in between (FORMAT.md
// "Publication"). kRetry when the files changed meanwhile.
Located map_generation(Context& ctx, Sink& sink, bool populate) {
  const FileId order[kFileCount] = {kIdx, kBin, kLoss, kSeqIdx, kSeqBin};
  for (FileId id : order) {
    std::string why;
    if (ctx.file[id].map(ctx.path[id], populate, &why)) continue;
    if (ctx.file[id].error() == ENOENT) return Located::kRetry;  // removed by a replacement
    sink.unreadable = true;
    sink.add(make_finding("FILE_UNREADABLE", ctx, id, "cannot open or map: " + why));
    return Located::kDone;
  }
  struct stat now;
  if (::stat(ctx.path[kIdx].c_str(), &now) != 0 || uint64_t(now.st_dev) != ctx.file[kIdx].dev() ||
      uint64_t(now.st_ino) != ctx.file[kIdx].ino())
    return Located::kRetry;
  for (int id = 0; id < kFileCount; ++id) ctx.stat_size[id] = ctx.file[id].size();
  return Located::kOk;
}

// Presence, kind, missing files; kRetry while .idx is missing but other files exist
// (the middle of a replacement), unless `last`.
Located classify(Context& ctx, Sink& sink, bool last) {
  int present = 0;
  for (int id = 0; id < kFileCount; ++id) present += ctx.present[id];
  if (present == 0) {
    sink.unreadable = true;
    sink.add(make_finding("SHARD_NOT_FOUND", ctx, -1, "no shard at this prefix: none of .bin .idx .loss.bin "
                          ".seq.idx .seq.bin exists"));
    return Located::kDone;
  }
  if (!ctx.present[kIdx] && !last) return Located::kRetry;
  const bool companions = ctx.present[kLoss] || ctx.present[kSeqIdx] || ctx.present[kSeqBin];
  if (!companions && ctx.present[kBin] && ctx.present[kIdx]) {
    sink.add(make_finding("PRETRAIN_SHARD", ctx, kIdx, "only .bin/.idx exist: upstream pretrain data, not "
                          "an SFT shard (this validator checks SFT shards)"));
    return Located::kDone;
  }
  bool missing = false;
  for (int id = 0; id < kFileCount; ++id) {
    if (ctx.present[id]) continue;
    missing = true;
    sink.add(make_finding("FILE_MISSING", ctx, id, std::string(kSuffix[id]) + " is missing; a shard is all five "
                          "files (.bin .idx .loss.bin .seq.idx .seq.bin)"));
  }
  return missing ? Located::kDone : Located::kOk;
}

}  // namespace

bool locate_and_map(Context& ctx, Sink& sink, bool populate) {
  unsigned pause = kOpenFirstPauseUs;
  for (int attempt = 1;; ++attempt) {
    const bool last = attempt == kOpenAttempts;
    Located r = stat_files(ctx, sink);
    if (r == Located::kOk) r = classify(ctx, sink, last);
    if (r == Located::kOk) r = map_generation(ctx, sink, populate);
    if (r == Located::kOk) return true;
    if (r == Located::kDone) return false;
    for (MappedFile& f : ctx.file) f = MappedFile();
    if (last) {
      sink.unreadable = true;
      sink.add(make_finding("FILE_UNREADABLE", ctx, -1, "the shard was replaced while it was being opened, " +
                            to_str(uint64_t(kOpenAttempts)) + " times; open it again once the replacement is done"));
      return false;
    }
    ::usleep(pause);
    pause = pause * 2 < kOpenMaxPauseUs ? pause * 2 : kOpenMaxPauseUs;
  }
}

// ---------------------------------------------------------------- P.idx

void check_idx_header(Context& ctx, Sink& sink) {
  const MappedFile& m = ctx.f(kIdx);
  const uint8_t* p = m.data();
  if (m.size() < kIdxHeaderSize) {
    sink.add(make_finding("IDX_TRUNCATED", ctx, kIdx, "file is shorter than the 34-byte MMIDIDX header",
                          {"size", to_str(kIdxHeaderSize) + " bytes or more", to_str(m.size())}, 0));
    return;
  }
  if (std::memcmp(p, kIdxMagic, sizeof kIdxMagic) != 0) {
    sink.add(make_finding("IDX_BAD_MAGIC", ctx, kIdx, "not a Megatron index: bad magic",
                          {"magic", "MMIDIDX\\x00\\x00", "other bytes"}, 0));
    return;
  }
  const uint64_t version = le64(p + kIdxOffVersion);
  if (version != kIdxVersion) {
    sink.add(make_finding("IDX_BAD_VERSION", ctx, kIdx, "unsupported MMIDIDX version; supported: 1",
                          {"version", "1", to_str(version)}, kIdxOffVersion));
    return;
  }
  const uint8_t code = p[kIdxOffDtype];
  if (!is_token_code(code)) {
    sink.add(make_finding("IDX_BAD_DTYPE", ctx, kIdx, "token dtype code is not a shard token dtype",
                          {"dtype_code", "8 (uint16) or 4 (int32)", to_str(code)}, kIdxOffDtype));
    return;
  }
  IdxHeader h;
  h.dtype_code = code;
  h.sequence_count = le64(p + kIdxOffSeqCount);
  h.document_count = le64(p + kIdxOffDocCount);
  ctx.idx = h;
  uint64_t expected = 0, tmp = 0;
  const bool fits = madd_ok(kIdxHeaderSize, 12, h.sequence_count, &tmp) && madd_ok(tmp, 8, h.document_count, &expected);
  if (!fits || expected != m.size()) {
    sink.add(make_finding("IDX_SIZE_MISMATCH", ctx, kIdx, "index size disagrees with its header counts "
                          "(file size must be 34 + 12*sequence_count + 8*document_count)",
                          {"sequence_count/document_count", fits ? to_str(expected) : "a size that overflows",
                           to_str(m.size())}, kIdxOffSeqCount));
    return;
  }
  ctx.idx_arrays_ok = true;
}

// ---------------------------------------------------------------- P.seq.idx

namespace {

SeqIdxHeader read_seq_fields(const uint8_t* p) {
  SeqIdxHeader h;
  h.version_major = le16(p + kSeqOffMajor);
  h.version_minor = le16(p + kSeqOffMinor);
  h.token_dtype_code = p[kSeqOffTokenDtype];
  h.seq_dtype_code = p[kSeqOffSeqDtype];
  h.loss_dtype_code = p[kSeqOffLossDtype];
  h.flags = p[kSeqOffFlags];
  h.pack_count = le64(p + kSeqOffPackCount);
  h.sequence_count = le64(p + kSeqOffSeqCount);
  h.token_count = le64(p + kSeqOffTokenCount);
  h.metadata_length = le64(p + kSeqOffMetaLen);
  h.csr_offset = le64(p + kSeqOffCsr);
  h.body_crc32 = le32(p + kSeqOffBodyCrc);
  h.header_crc32 = le32(p + kSeqOffHeaderCrc);
  return h;
}

// Every field's own constraint; false when one makes the header unusable.
bool seq_fields_valid(const Context& ctx, const SeqIdxHeader& h, Sink& sink) {
  bool ok = true;
  auto bad = [&](const char* code, const char* what, Detail d, size_t off) {
    ok = false;
    sink.add(make_finding(code, ctx, kSeqIdx, what, std::move(d), int64_t(off)));
  };
  if (!is_token_code(h.token_dtype_code))
    bad("SEQ_IDX_BAD_DTYPE", "token dtype code is not a shard token dtype",
        {"token_dtype_code", "8 (uint16) or 4 (int32)", to_str(h.token_dtype_code)}, kSeqOffTokenDtype);
  if (h.seq_dtype_code != uint8_t(DType::int32))
    bad("SEQ_IDX_BAD_DTYPE", "seq_start_id dtype code must be int32",
        {"seq_dtype_code", "4", to_str(h.seq_dtype_code)}, kSeqOffSeqDtype);
  if (h.loss_dtype_code != uint8_t(DType::uint8))
    bad("SEQ_IDX_BAD_DTYPE", "loss mask dtype code must be uint8",
        {"loss_dtype_code", "1", to_str(h.loss_dtype_code)}, kSeqOffLossDtype);
  if (h.flags & ~kKnownFlags)
    bad("SEQ_IDX_BAD_HEADER", "reserved flags are set", {"flags", "bits of " + to_str(kKnownFlags), to_str(h.flags)},
        kSeqOffFlags);
  else if (h.has_sources() && h.version_minor < kSourcesMinor)
    bad("SEQ_IDX_BAD_HEADER", "the sources flag needs version 1.2", {"flags", "version >= 1.2",
        "1." + to_str(h.version_minor)}, kSeqOffFlags);
  if (h.metadata_length > kMaxMetadataLength) {
    bad("SEQ_IDX_BAD_HEADER", "metadata length is implausible",
        {"metadata_length", "<= " + to_str(kMaxMetadataLength), to_str(h.metadata_length)}, kSeqOffMetaLen);
  } else if (h.csr_offset != align64(kMetadataOffset + h.metadata_length)) {
    bad("SEQ_IDX_BAD_HEADER", "CSR offset is not the 64-byte aligned end of the metadata",
        {"csr_offset", to_str(align64(kMetadataOffset + h.metadata_length)), to_str(h.csr_offset)}, kSeqOffCsr);
  }
  if (h.pack_count == 0)
    bad("SEQ_IDX_BAD_HEADER", "a shard holds at least one pack", {"pack_count", ">= 1", "0"}, kSeqOffPackCount);
  const struct { const char* name; uint64_t value; size_t off; } counts[] = {
      {"pack_count", h.pack_count, kSeqOffPackCount}, {"sequence_count", h.sequence_count, kSeqOffSeqCount},
      {"token_count", h.token_count, kSeqOffTokenCount}};
  for (const auto& c : counts)
    if (c.value > kMaxCount)
      bad("SEQ_IDX_BAD_HEADER", "a count exceeds the format's limit",
          {c.name, "<= " + to_str(kMaxCount), to_str(c.value)}, c.off);
  if (h.sequence_count < h.pack_count)
    bad("SEQ_IDX_BAD_HEADER", "fewer sequences than packs (every pack holds at least one)",
        {"sequence_count", ">= " + to_str(h.pack_count), to_str(h.sequence_count)}, kSeqOffSeqCount);
  if (h.token_count < h.pack_count)
    bad("SEQ_IDX_BAD_HEADER", "fewer tokens than packs (every pack holds at least one)",
        {"token_count", ">= " + to_str(h.pack_count), to_str(h.token_count)}, kSeqOffTokenCount);
  return ok;
}

// Metadata, the zero padding before the CSR offsets, and (optionally) the body CRC.
void check_seq_idx_body(Context& ctx, Sink& sink, const SeqIdxHeader& h, bool body_crc) {
  const uint8_t* p = ctx.f(kSeqIdx).data();
  const uint64_t size = ctx.f(kSeqIdx).size();
  const uint64_t meta_end = kMetadataOffset + h.metadata_length;  // bounded by kMaxMetadataLength
  if (meta_end <= size) {
    ctx.metadata_json = std::string_view(reinterpret_cast<const char*>(p + kMetadataOffset), h.metadata_length);
    ctx.meta = parse_metadata(ctx.metadata_json, ctx.path[kSeqIdx], sink);
  } else {
    sink.add(make_finding("CHECK_SKIPPED", ctx, kSeqIdx, "metadata not read: the file ends at byte " + to_str(size) +
                          ", before the metadata's end at " + to_str(meta_end), {}, -1, -1, Severity::info));
  }
  const uint64_t pad_end = h.csr_offset < size ? h.csr_offset : size;
  for (uint64_t j = meta_end; j < pad_end; ++j) {
    if (p[j] != 0) {
      sink.add(make_finding("SEQ_IDX_BAD_PADDING", ctx, kSeqIdx, "non-zero byte between the metadata and the CSR "
                            "offsets", {"padding", "0", to_str(p[j])}, int64_t(j)));
      break;
    }
  }
  if (h.has_sources() && ctx.csr_ok) {  // 1.2: the bytes between the CSR offsets and the source ids
    for (uint64_t j = h.csr_end(); j < h.sources_offset(); ++j) {
      if (p[j] != 0) {
        sink.add(make_finding("SEQ_IDX_BAD_PADDING", ctx, kSeqIdx, "non-zero byte between the CSR offsets and the "
                              "source ids", {"padding", "0", to_str(p[j])}, int64_t(j)));
        break;
      }
    }
  }
  if (body_crc) {
    const uint32_t crc = crc32_bytes(p + kSeqIdxHeaderSize, size - kSeqIdxHeaderSize);
    if (crc != h.body_crc32) {
      sink.add(make_recorded_finding("SEQ_IDX_BODY_CRC", ctx, kSeqIdx, "body CRC-32 is " + hex32(crc) +
                                     ", the header records " + hex32(h.body_crc32), "body_crc32",
                                     hex32(h.body_crc32), hex32(crc), kSeqOffBodyCrc));
    }
  }
}

}  // namespace

void check_seq_idx_header(Context& ctx, Sink& sink, bool body_crc) {
  const MappedFile& m = ctx.f(kSeqIdx);
  const uint8_t* p = m.data();
  const uint64_t size = m.size();
  if (size < kSeqIdxHeaderSize) {
    sink.add(make_finding("SEQ_IDX_TRUNCATED", ctx, kSeqIdx, "file is shorter than the 64-byte .seq.idx header",
                          {"size", "64 bytes or more", to_str(size)}, 0));
    return;
  }
  if (std::memcmp(p, kSeqIdxMagic, sizeof kSeqIdxMagic) != 0) {
    sink.add(make_finding("SEQ_IDX_BAD_MAGIC", ctx, kSeqIdx, "not a megatron_sft_idx sequence index: bad magic",
                          {"magic", "MSFTSEQ\\x00", "other bytes"}, 0));
    return;
  }
  SeqIdxHeader h = read_seq_fields(p);
  if (h.version_major != kSupportedMajor) {
    sink.add(make_finding("SEQ_IDX_BAD_VERSION", ctx, kSeqIdx,
                          "unsupported .seq.idx major version " + to_str(h.version_major) + "." +
                          to_str(h.version_minor) + "; supported majors: 1",
                          {"version_major", "1", to_str(h.version_major)}, kSeqOffMajor));
    return;
  }
  const uint32_t header_crc = crc32_bytes(p, kSeqOffHeaderCrc);
  if (header_crc != h.header_crc32) {
    // Carry on: the fields below still say which one is wrong.
    sink.add(make_recorded_finding("SEQ_IDX_HEADER_CRC", ctx, kSeqIdx, "header CRC-32 is " + hex32(header_crc) +
                                   ", the header records " + hex32(h.header_crc32) +
                                   ": the header bytes were modified", "header_crc32", hex32(h.header_crc32),
                                   hex32(header_crc), kSeqOffHeaderCrc));
  }
  if (!seq_fields_valid(ctx, h, sink)) return;
  ctx.seq = h;
  uint64_t expected = 0;
  bool fits = madd_ok(h.csr_offset, 8, h.pack_count, &expected) && add_ok(expected, 8, &expected);
  if (fits && h.has_sources()) {  // 1.2: the source ids, 64-byte aligned after the offsets
    fits = add_ok(expected, 63, &expected);
    expected = expected / 64 * 64;
    fits = fits && madd_ok(expected, 2, h.sequence_count, &expected);
  }
  if (!fits || expected != size) {
    sink.add(make_finding("SEQ_IDX_SIZE_MISMATCH", ctx, kSeqIdx, h.has_sources() ?
                          ".seq.idx size disagrees with its header (file size must be align64(csr_offset + "
                          "8*(pack_count + 1)) + 2*sequence_count)" :
                          ".seq.idx size disagrees with its header (file size must be csr_offset + 8*(pack_count + 1))",
                          {h.has_sources() ? "pack_count/sequence_count/csr_offset" : "pack_count/csr_offset",
                           fits ? to_str(expected) : "a size that overflows", to_str(size)},
                          kSeqOffPackCount));
  } else {
    ctx.csr_ok = true;
  }
  if (h.version_minor > kKnownMinor) {
    sink.add(make_finding("SEQ_IDX_NEWER_MINOR", ctx, kSeqIdx, "newer minor version " + to_str(h.version_minor) +
                          " (only adds metadata keys; unknown keys are ignored)", {}, kSeqOffMinor, -1,
                          Severity::info));
  }
  check_seq_idx_body(ctx, sink, h, body_crc);
}

// ---------------------------------------------------------------- cross-file agreement

namespace {

// .bin, .loss.bin and .seq.bin sizes follow from the .seq.idx header counts.
bool sizes_vs_seq_header(const Context& ctx, Sink& sink, const SeqIdxHeader& h) {
  bool ok = true;
  const uint64_t item = itemsize(DType(h.token_dtype_code));
  struct Want { FileId id; const char* code; uint64_t count, scale; const char* what; };
  const Want wants[] = {{kBin, "BIN_SIZE_MISMATCH", h.token_count, item, "token_count * itemsize"},
                        {kLoss, "LOSS_SIZE_MISMATCH", h.token_count, 1, "token_count"},
                        {kSeqBin, "SEQ_BIN_SIZE_MISMATCH", h.sequence_count, 4, "sequence_count * 4"}};
  for (const Want& w : wants) {
    uint64_t want = 0;
    const bool fits = mul_ok(w.count, w.scale, &want);
    const uint64_t have = ctx.f(w.id).size();
    if (!fits || have != want) {
      ok = false;
      sink.add(make_finding(w.code, ctx, w.id, std::string("file size differs from the .seq.idx header's ") + w.what,
                            {"size", fits ? to_str(want) : "a size that overflows", to_str(have)},
                            int64_t(fits && want < have ? want : have)));
    }
  }
  return ok;
}

// Counts and sizes the metadata records.
void against_metadata(const Context& ctx, Sink& sink, const Metadata& meta) {
  const auto& ih = ctx.idx;
  const auto& sh = ctx.seq;
  if (sh && sh->has_sources() != meta.source_sequences.has_value()) {
    sink.add(make_finding("SOURCES_MISMATCH", ctx, kSeqIdx, std::string("the .seq.idx header's sources flag is ") +
                          (sh->has_sources() ? "set, but the metadata names no sources" :
                                               "clear, but the metadata names sources"),
                          {"flags", meta.source_sequences ? "1" : "0", to_str(sh->flags)}, kSeqOffFlags));
  }
  if (ih && meta.token_dtype != dtype_name(DType(ih->dtype_code))) {
    sink.add(make_finding("DTYPE_MISMATCH", ctx, kSeqIdx, "metadata token_dtype differs from the .idx dtype code",
                          {"token_dtype", dtype_name(DType(ih->dtype_code)), meta.token_dtype}, kMetadataOffset));
  }
  if (sh) {
    const struct { const char* name; uint64_t header; int64_t recorded; size_t off; } counts[] = {
        {"stats.pack_count", sh->pack_count, meta.stats.pack_count, kSeqOffPackCount},
        {"stats.sequence_count", sh->sequence_count, meta.stats.sequence_count, kSeqOffSeqCount},
        {"stats.token_count", sh->token_count, meta.stats.token_count, kSeqOffTokenCount}};
    for (const auto& c : counts) {
      if (c.recorded < 0 || uint64_t(c.recorded) != c.header) {
        sink.add(make_recorded_finding("METADATA_STATS_MISMATCH", ctx, kSeqIdx, std::string(c.name) + " is " +
                                       to_str_i(c.recorded) + ", the header says " + to_str(c.header), c.name,
                                       to_str(c.header), to_str_i(c.recorded), int64_t(c.off)));
      }
    }
  }
  for (int k = 0; k < 4; ++k) {
    const FileId id = kChecksummedIds[k];
    const uint64_t recorded = meta.files[k].size, have = ctx.f(id).size();
    if (recorded != have) {
      sink.add(make_recorded_finding(have < recorded ? "FILE_TRUNCATED" : "FILE_SIZE_MISMATCH", ctx, id,
                                     to_str(have) + " bytes; the metadata records " + to_str(recorded),
                                     std::string("files.") + kSuffix[id] + ".size", to_str(recorded), to_str(have),
                                     int64_t(have < recorded ? have : recorded)));
    }
  }
}

}  // namespace

void cross_check(Context& ctx, Sink& sink) {
  bool ok = ctx.idx_arrays_ok && ctx.csr_ok;
  const auto& ih = ctx.idx;
  const auto& sh = ctx.seq;
  if (ih && ih->document_count != ih->sequence_count + 1) {
    ok = false;
    sink.add(make_finding("IDX_DOCUMENT_COUNT", ctx, kIdx, "an SFT .idx holds one document per pack",
                          {"document_count", "sequence_count + 1 = " + to_str(ih->sequence_count + 1),
                           to_str(ih->document_count)}, kIdxOffDocCount));
  }
  if (ih && sh) {
    if (ih->sequence_count != sh->pack_count) {
      ok = false;
      sink.add(make_finding("PACK_COUNT_MISMATCH", ctx, kSeqIdx, ".idx and .seq.idx hold different pack counts "
                            "(a companion from another shard?)",
                            {"pack_count", to_str(ih->sequence_count) + " (.idx sequence_count)",
                             to_str(sh->pack_count)}, kSeqOffPackCount));
    }
    if (ih->dtype_code != sh->token_dtype_code) {
      ok = false;
      sink.add(make_finding("DTYPE_MISMATCH", ctx, kSeqIdx, "token dtype code differs between .idx and .seq.idx",
                            {"token_dtype_code", to_str(ih->dtype_code) + " (.idx)", to_str(sh->token_dtype_code)},
                            kSeqOffTokenDtype));
    }
  }
  if (sh) ok &= sizes_vs_seq_header(ctx, sink, *sh);
  if (ctx.meta) against_metadata(ctx, sink, *ctx.meta);  // wrong recorded sizes do not make the arrays unsafe
  ctx.sizes_ok = ok;
}

}  // namespace detail
}  // namespace sft_idx
