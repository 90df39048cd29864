// sft_idx_c.cpp -- the extern "C" ABI (sft_idx_c.h) over the C++ API. Every entry
// point catches everything: no exception crosses into C.
#include "sft_idx_c.h"

#include <cstring>
#include <memory>
#include <new>
#include <string>

#include "sft_idx.hpp"

struct sft_idx_shard {
  std::unique_ptr<sft_idx::Shard> shard;
};

struct sft_idx_report {
  sft_idx::Report report;
};

namespace {

void copy_into(char* dst, size_t cap, const std::string& src) {
  const size_t n = src.size() < cap - 1 ? src.size() : cap - 1;
  std::memcpy(dst, src.data(), n);
  dst[n] = '\0';
}

void fill(sft_idx_error* err, const sft_idx::Error& e) {
  if (err == nullptr) return;
  copy_into(err->code, sizeof err->code, e.code);
  copy_into(err->file, sizeof err->file, e.file);
  copy_into(err->message, sizeof err->message, e.message);
  err->pack = e.pack;
}

void fill(sft_idx_error* err, const char* code, const char* message) {
  sft_idx::Error e;
  e.code = code;
  e.message = message;
  e.file = "(sft_idx)";
  fill(err, e);
}

}  // namespace

extern "C" {

int sft_idx_abi_version(void) { return SFT_IDX_ABI_VERSION; }

int sft_idx_open(const char* prefix, sft_idx_shard** out, sft_idx_error* err) {
  if (out == nullptr || prefix == nullptr) {
    fill(err, "BAD_ARGUMENT", "prefix and out must not be NULL");
    return -1;
  }
  *out = nullptr;
  try {
    auto opened = sft_idx::Shard::open(prefix);
    if (!opened) {
      fill(err, opened.error());
      return -1;
    }
    *out = new sft_idx_shard{std::move(opened).value()};
    return 0;
  } catch (const std::bad_alloc&) {
    fill(err, "OUT_OF_MEMORY", "out of memory");
  } catch (...) {
    fill(err, "INTERNAL_ERROR", "unexpected internal error");
  }
  return -1;
}

void sft_idx_close(sft_idx_shard* shard) { delete shard; }

uint64_t sft_idx_size(const sft_idx_shard* s) { return s ? s->shard->size() : 0; }
uint64_t sft_idx_sequence_count(const sft_idx_shard* s) { return s ? s->shard->sequence_count() : 0; }
uint64_t sft_idx_token_count(const sft_idx_shard* s) { return s ? s->shard->token_count() : 0; }
int32_t sft_idx_token_dtype(const sft_idx_shard* s) { return s ? int32_t(s->shard->token_dtype()) : 0; }
int64_t sft_idx_pack_size(const sft_idx_shard* s) { return s ? s->shard->metadata().pack_size.value_or(-1) : -1; }
int64_t sft_idx_vocab_size(const sft_idx_shard* s) { return s ? s->shard->metadata().vocab_size.value_or(-1) : -1; }
int64_t sft_idx_pad_seq_to_mult(const sft_idx_shard* s) { return s ? s->shard->metadata().pad_seq_to_mult : 1; }

int sft_idx_metadata_json(const sft_idx_shard* s, const char** data, uint64_t* size) {
  if (s == nullptr || data == nullptr || size == nullptr) return -1;
  const std::string_view json = s->shard->metadata_json();
  *data = json.data();
  *size = json.size();
  return 0;
}

int sft_idx_get_pack(const sft_idx_shard* s, uint64_t index, sft_idx_pack* out, sft_idx_error* err) {
  if (s == nullptr || out == nullptr) {
    fill(err, "BAD_ARGUMENT", "shard and out must not be NULL");
    return -1;
  }
  try {
    auto pack = s->shard->pack(index);
    if (!pack) {
      fill(err, pack.error());
      return -1;
    }
    const sft_idx::PackView& v = pack.value();
    out->input_ids = v.input_ids;
    out->loss_mask = v.loss_mask.data;
    out->seq_start_id = v.seq_start_id.data;
    out->packed_len = v.packed_len;
    out->num_seqs = v.seq_start_id.size;
    out->token_dtype_code = int32_t(v.token_dtype);
    out->reserved = 0;
    return 0;
  } catch (const std::bad_alloc&) {
    fill(err, "OUT_OF_MEMORY", "out of memory");
  } catch (...) {
    fill(err, "INTERNAL_ERROR", "unexpected internal error");
  }
  return -1;
}

int sft_idx_check_pack(const sft_idx_shard* s, uint64_t index, int64_t vocab_override, int64_t* position,
                       sft_idx_error* err) {
  if (s == nullptr) {
    fill(err, "BAD_ARGUMENT", "shard must not be NULL");
    return -1;
  }
  try {
    auto pack = s->shard->pack(index);
    if (!pack) {
      fill(err, pack.error());
      return -1;
    }
    const sft_idx::PackCheck c = s->shard->check_pack(pack.value(), vocab_override);
    if (position != nullptr) *position = c.position;
    return int(c.rule);
  } catch (...) {
    fill(err, "INTERNAL_ERROR", "unexpected internal error");
    return -1;
  }
}

sft_idx_report* sft_idx_validate(const char* prefix, int checksums, int64_t vocab_size, uint64_t max_findings) {
  if (prefix == nullptr) return nullptr;
  try {
    sft_idx::ValidateOptions options;
    options.checksums = checksums != 0;
    if (vocab_size > 0) options.vocab_size = vocab_size;
    options.max_findings = size_t(max_findings);
    auto* r = new sft_idx_report;
    r->report = sft_idx::validate(prefix, options);
    return r;
  } catch (...) {
    return nullptr;
  }
}

int sft_idx_report_verdict(const sft_idx_report* r) { return r ? int(r->report.verdict) : 2; }
uint64_t sft_idx_report_count(const sft_idx_report* r) { return r ? r->report.findings.size() : 0; }
uint64_t sft_idx_report_total(const sft_idx_report* r) { return r ? r->report.total_findings : 0; }
uint64_t sft_idx_report_errors(const sft_idx_report* r) { return r ? r->report.errors : 0; }

int sft_idx_report_finding(const sft_idx_report* r, uint64_t k, sft_idx_finding* out) {
  if (r == nullptr || out == nullptr || k >= r->report.findings.size()) return -1;
  const sft_idx::Finding& f = r->report.findings[k];
  out->code = f.code.c_str();
  out->severity = sft_idx::severity_name(f.severity);
  out->file = f.file.c_str();
  out->message = f.message.c_str();
  out->rule = int32_t(f.rule);
  out->reserved = 0;
  out->pack = f.pack;
  out->offset = f.offset;
  return 0;
}

void sft_idx_report_free(sft_idx_report* r) { delete r; }

}  // extern "C"
