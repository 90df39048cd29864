/* sft_idx_c.h -- C ABI of the native megatron_sft_idx reader/validator (for FFI: ctypes, cffi, Rust).
 *
 * Conventions: functions that can fail return 0 on success and -1 on failure,
 * filling *err (when err is not NULL); nothing crosses this boundary as a C++
 * exception; nothing prints. Pointers handed out (pack spans, metadata JSON,
 * finding strings) live as long as the shard / report they came from. A shard
 * may be read from many threads at once; close it once, after every reader.
 */
#ifndef SFT_IDX_C_H_
#define SFT_IDX_C_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define SFT_IDX_ABI_VERSION 1

typedef struct sft_idx_shard sft_idx_shard;
typedef struct sft_idx_report sft_idx_report;

typedef struct {
  char code[48];       /* stable code, e.g. "SEQ_IDX_HEADER_CRC", "PACK_OUT_OF_BOUNDS" */
  char file[1024];     /* full path of the file concerned (the prefix when about the shard), truncated */
  char message[1024];  /* "<what> (field F: expected E, found A)", truncated */
  int64_t pack;        /* -1 when not about one pack */
} sft_idx_error;

typedef struct {
  const void* input_ids;        /* packed_len elements of token_dtype_code (8 uint16, 4 int32) */
  const uint8_t* loss_mask;     /* packed_len values */
  const int32_t* seq_start_id;  /* num_seqs values */
  uint64_t packed_len;
  uint64_t num_seqs;
  int32_t token_dtype_code;
  int32_t reserved;
} sft_idx_pack;

typedef struct {
  const char* code;      /* the gate's finding code, e.g. "LOSS_NOT_BINARY" */
  const char* severity;  /* "error", "warning" or "info" */
  const char* file;      /* full path (the prefix when about the shard) */
  const char* message;   /* self-contained */
  int32_t rule;          /* 1..13 for pack invariants, else 0 */
  int32_t reserved;
  int64_t pack;          /* -1 when none */
  int64_t offset;        /* byte offset in file, -1 when none */
} sft_idx_finding;

int sft_idx_abi_version(void);

/* ---- reader */
int sft_idx_open(const char* prefix, sft_idx_shard** out, sft_idx_error* err);
void sft_idx_close(sft_idx_shard* shard);
uint64_t sft_idx_size(const sft_idx_shard* shard);            /* packs */
uint64_t sft_idx_sequence_count(const sft_idx_shard* shard);
uint64_t sft_idx_token_count(const sft_idx_shard* shard);
int32_t sft_idx_token_dtype(const sft_idx_shard* shard);      /* Megatron dtype code */
int64_t sft_idx_pack_size(const sft_idx_shard* shard);        /* -1 when null */
int64_t sft_idx_vocab_size(const sft_idx_shard* shard);       /* -1 when null */
int64_t sft_idx_pad_seq_to_mult(const sft_idx_shard* shard);
/* The metadata JSON bytes (not NUL-terminated). */
int sft_idx_metadata_json(const sft_idx_shard* shard, const char** data, uint64_t* size);
int sft_idx_get_pack(const sft_idx_shard* shard, uint64_t index, sft_idx_pack* out, sft_idx_error* err);
/* The pack invariants of pack `index`: returns the rule broken (0 = none, 1..13) and its
 * position in *position, or -1 with *err filled when the pack cannot be read. */
int sft_idx_check_pack(const sft_idx_shard* shard, uint64_t index, int64_t vocab_override, int64_t* position,
                       sft_idx_error* err);

/* ---- validator: never NULL unless out of memory. vocab_size <= 0: use the metadata's. */
sft_idx_report* sft_idx_validate(const char* prefix, int checksums, int64_t vocab_size, uint64_t max_findings);
int sft_idx_report_verdict(const sft_idx_report* report);       /* 0 pass, 1 fail, 2 unreadable */
uint64_t sft_idx_report_count(const sft_idx_report* report);    /* findings kept */
uint64_t sft_idx_report_total(const sft_idx_report* report);    /* findings, including beyond the cap */
uint64_t sft_idx_report_errors(const sft_idx_report* report);
int sft_idx_report_finding(const sft_idx_report* report, uint64_t k, sft_idx_finding* out);
void sft_idx_report_free(sft_idx_report* report);

#ifdef __cplusplus
}
#endif
#endif /* SFT_IDX_C_H_ */
