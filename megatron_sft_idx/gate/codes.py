"""The gate's finding codes: stable names, default severities, and what to do.

A code names one kind of problem and never changes meaning; new codes are
appended. ``docs/GATE.md`` renders this table (a test keeps the two in step).
Severities: ``error`` fails the shard, ``warning`` fails it only with
``strict=True``, ``info`` never does.
"""

from __future__ import annotations

from typing import Dict, NamedTuple

from ..format import Rule

ERROR = "error"
WARNING = "warning"
INFO = "info"
SEVERITIES = (ERROR, WARNING, INFO)


class Code(NamedTuple):
    severity: str
    file: str     # the file a finding of this code points at ("shard" when several)
    meaning: str
    action: str


_REBUILD = "rebuild the shard (or restore the file from the copy it came from)"
_RECOPY = "copy the file again from its source, or rebuild the shard"

CODES: Dict[str, Code] = {
    # ---- presence and input
    "FILE_MISSING": Code(ERROR, "shard", "a file the shard needs does not exist (interrupted write or copy)",
                         "copy all five files (.bin .idx .loss.bin .seq.idx .seq.bin) or rebuild"),
    "FILE_UNREADABLE": Code(ERROR, "shard", "a file exists but cannot be opened, read or mapped",
                            "fix permissions or the storage; the check exits 2"),
    "PRETRAIN_SHARD": Code(ERROR, ".idx", "only .bin/.idx exist: upstream pretrain data, no loss mask "
                           "or sequence starts (info with allow_pretrain)",
                           "pass --allow-pretrain if pretrain data is intended, else rebuild as SFT"),
    # ---- .idx
    "IDX_TRUNCATED": Code(ERROR, ".idx", ".idx is shorter than its 34-byte header", _RECOPY),
    "IDX_BAD_MAGIC": Code(ERROR, ".idx", ".idx does not start with the MMIDIDX magic", _REBUILD),
    "IDX_BAD_VERSION": Code(ERROR, ".idx", ".idx version is not 1", _REBUILD),
    "IDX_BAD_DTYPE": Code(ERROR, ".idx", "unknown or disallowed token dtype code in .idx", _REBUILD),
    "IDX_SIZE_MISMATCH": Code(ERROR, ".idx", ".idx size disagrees with its header counts "
                              "(cut short, extended, or a corrupt count)", _RECOPY),
    "IDX_DOCUMENT_COUNT": Code(ERROR, ".idx", "an SFT .idx must hold pack_count + 1 document indices",
                               _REBUILD),
    "IDX_LENGTH_NONPOSITIVE": Code(ERROR, ".idx", "a sequence length is <= 0", _REBUILD),
    "IDX_POINTER_MISMATCH": Code(ERROR, ".idx", "a byte pointer is not the previous pointer plus "
                                 "length x itemsize (duplicated pointer, lengths and pointers disagree)",
                                 _REBUILD),
    "IDX_POINTER_INT32_OVERFLOW": Code(ERROR, ".idx", "pointers wrapped around at 2 GiB: the writer "
                                       "accumulated them in int32", "rebuild with a writer that uses int64 "
                                       "pointers (this project's builder does)"),
    "IDX_DOCUMENT_INDICES": Code(ERROR, ".idx", "document_indices do not start at 0, decrease, or do not "
                                 "end at the sequence count (SFT: must be 0..N)", _REBUILD),
    "BIN_SIZE_MISMATCH": Code(ERROR, ".bin", ".bin size differs from what .idx / .seq.idx say "
                              "(last pointer + last length x itemsize; token_count x itemsize)", _RECOPY),
    # ---- .seq.idx
    "SEQ_IDX_TRUNCATED": Code(ERROR, ".seq.idx", ".seq.idx is shorter than its 64-byte header", _RECOPY),
    "SEQ_IDX_BAD_MAGIC": Code(ERROR, ".seq.idx", ".seq.idx does not start with the MSFTSEQ magic", _REBUILD),
    "SEQ_IDX_BAD_VERSION": Code(ERROR, ".seq.idx", ".seq.idx major version is not supported",
                                "read it with the megatron_sft_idx version that wrote it, or rebuild"),
    "SEQ_IDX_NEWER_MINOR": Code(INFO, ".seq.idx", ".seq.idx has a newer minor version (only adds metadata "
                                "keys; unknown keys are ignored)", "nothing, or upgrade megatron_sft_idx"),
    "SEQ_IDX_HEADER_CRC": Code(ERROR, ".seq.idx", "the .seq.idx header CRC-32 does not match its bytes",
                               _RECOPY),
    "SEQ_IDX_BAD_DTYPE": Code(ERROR, ".seq.idx", "a dtype code in the .seq.idx header is not the one the "
                              "format requires", _REBUILD),
    "SEQ_IDX_BAD_HEADER": Code(ERROR, ".seq.idx", "a .seq.idx header field is impossible (flags, counts, "
                               "metadata length, CSR offset)", _REBUILD),
    "SEQ_IDX_SIZE_MISMATCH": Code(ERROR, ".seq.idx", ".seq.idx size disagrees with its header", _RECOPY),
    "SEQ_IDX_BAD_PADDING": Code(ERROR, ".seq.idx", "the bytes between the metadata and the CSR offsets "
                                "are not zero", _REBUILD),
    "SEQ_IDX_BODY_CRC": Code(ERROR, ".seq.idx", "the .seq.idx body (metadata + CSR offsets) CRC-32 does not "
                             "match", _RECOPY),
    "SEQ_IDX_OFFSETS": Code(ERROR, ".seq.idx", "CSR seq_offsets do not start at 0, are not strictly "
                            "increasing, or do not end at the number of values in .seq.bin", _REBUILD),
    "SOURCES_MISMATCH": Code(ERROR, ".seq.idx", "format 1.2: the header's sources flag and the metadata's "
                             "sources disagree, or a source's recorded sequence count is not the number of "
                             "source ids naming it", _REBUILD),
    "SOURCE_ID_OUT_OF_RANGE": Code(ERROR, ".seq.idx", "format 1.2: a sequence's source id names no source of "
                                   "the metadata's sources", _REBUILD),
    "METADATA_UNPARSABLE": Code(ERROR, ".seq.idx", "the metadata is not valid UTF-8 JSON (cut short, "
                                "overwritten)", _REBUILD),
    "METADATA_INVALID": Code(ERROR, ".seq.idx", "a required metadata key is missing or has the wrong type "
                             "or a value outside its range (docs/FORMAT.md \"Limits\")", _REBUILD),
    "METADATA_LIMIT": Code(ERROR, ".seq.idx", "the metadata exceeds a limit of the format (docs/FORMAT.md "
                           "\"Limits\": containers nested deeper than 64, an integer outside int64, a number "
                           "that overflows a double)", _REBUILD),
    "METADATA_STATS_MISMATCH": Code(ERROR, ".seq.idx", "metadata statistics disagree with the header or "
                                    "with the statistics recomputed from the data (Megatron-Bridge's "
                                    "pad_cu_seqlens would use wrong values)", _REBUILD),
    "PACK_COUNT_MISMATCH": Code(ERROR, ".seq.idx", ".idx and .seq.idx hold different pack counts "
                                "(a companion from another shard?)", "copy the five files of one shard together"),
    "DTYPE_MISMATCH": Code(ERROR, ".seq.idx", "token dtype differs between .idx, the .seq.idx header and "
                           "the metadata", "copy the five files of one shard together, or rebuild"),
    "VOCAB_DIFFERS_FROM_METADATA": Code(WARNING, ".seq.idx", "--vocab-size differs from the vocab_size "
                                        "recorded in the metadata (the given one is checked)",
                                        "check that the shard was tokenized for this model"),
    "VOCAB_UNKNOWN": Code(INFO, ".seq.idx", "no vocab size given or recorded: token ids were checked only "
                          "against the dtype's range", "pass --vocab-size to check ids against the model"),
    # ---- the other files
    "LOSS_SIZE_MISMATCH": Code(ERROR, ".loss.bin", ".loss.bin size is not the token count", _RECOPY),
    "SEQ_BIN_SIZE_MISMATCH": Code(ERROR, ".seq.bin", ".seq.bin size is not sequence_count x 4", _RECOPY),
    "FILE_TRUNCATED": Code(ERROR, "shard", "a file is smaller than the size recorded in the metadata",
                           _RECOPY),
    "FILE_SIZE_MISMATCH": Code(ERROR, "shard", "a file is larger than (or otherwise differs from) the size "
                               "recorded in the metadata (extended, or swapped in from another shard)",
                               "copy the five files of one shard together, or rebuild"),
    "CHECKSUM_MISMATCH": Code(ERROR, "shard", "a file's CRC-32 differs from the one recorded when the shard "
                              "was written (bit rot, edit, or a same-size file from another shard)", _RECOPY),
    "CHECKSUMS_SKIPPED": Code(INFO, "shard", "the CRC-32 pass over the data files did not run (--fast, or "
                              "no metadata to compare with)", "check at standard level (and with valid metadata) before promotion"),
    # ---- every pack (one per format.Rule)
    "PACK_EMPTY": Code(ERROR, ".idx", "a pack holds no tokens (0 < packed_len)", _REBUILD),
    "PACK_TOO_LONG": Code(ERROR, ".idx", "packed_len exceeds the metadata pack_size", _REBUILD),
    "LOSS_LENGTH_MISMATCH": Code(ERROR, ".loss.bin", "the loss mask does not have one value per token",
                                 _REBUILD),
    "LOSS_NOT_BINARY": Code(ERROR, ".loss.bin", "a loss mask value is not 0 or 1", _REBUILD),
    "LOSS_ON_LAST_POSITION": Code(ERROR, ".loss.bin", "loss 1 on the last position of a sequence "
                                  "(label-aligned: nothing follows it to predict; an off-by-one mask)",
                                  "fix the producer's mask alignment and rebuild"),
    "SEQ_NONE": Code(ERROR, ".seq.bin", "a pack has no sequence start", _REBUILD),
    "SEQ_FIRST_NOT_ZERO": Code(ERROR, ".seq.bin", "seq_start_id[0] is not 0", _REBUILD),
    "SEQ_NOT_INCREASING": Code(ERROR, ".seq.bin", "seq_start_id is not strictly increasing", _REBUILD),
    "SEQ_START_OUT_OF_RANGE": Code(ERROR, ".seq.bin", "a seq_start_id is >= packed_len", _REBUILD),
    "SEQ_NOT_PAD_MULTIPLE": Code(ERROR, ".seq.bin", "a sequence length (pad_layout 'stored') or length "
                                 "minus one (pad_layout 'runtime') is not a multiple of the metadata "
                                 "pad_seq_to_mult", _REBUILD),
    "TOKEN_NEGATIVE": Code(ERROR, ".bin", "a token id is negative", _REBUILD),
    "TOKEN_TOO_LARGE": Code(ERROR, ".bin", "a token id does not fit the token dtype", _REBUILD),
    "TOKEN_OUT_OF_VOCAB": Code(ERROR, ".bin", "a token id is >= the vocab size (--vocab-size or metadata)",
                               "re-tokenize with the model's tokenizer, or pass the right --vocab-size"),
    "ZERO_LOSS_PACK": Code(WARNING, ".loss.bin", "a pack's loss mask is all zero: it costs compute and "
                           "trains nothing (error with --strict)", "check the chat template / masking"),
    # ---- read-back
    "READBACK_MISMATCH": Code(ERROR, "shard", "a pack read through MMapIndexedDataset differs from the raw "
                              "arrays", "report a reader bug with this shard attached"),
    "READER_REFUSED": Code(ERROR, "shard", "MMapIndexedDataset refused a shard the gate's own passes "
                           "accepted (or could not read a pack)", "report it with this shard attached"),
    "READER_CRASHED": Code(ERROR, "shard", "MMapIndexedDataset raised something other than ShardError",
                           "report a reader bug with this shard attached"),
    # ---- the gate itself
    "CHECK_SKIPPED": Code(INFO, "shard", "a pass did not run because an earlier finding makes its input "
                          "untrustworthy", "fix the earlier findings and check again"),
    "GATE_INTERNAL_ERROR": Code(ERROR, "shard", "a check pass raised an unexpected exception "
                                "(the shard is failed to be safe)", "report a gate bug with this shard"),
    # ---- promotion
    "PROMOTED": Code(INFO, "shard", "the shard was moved or linked into the destination", "nothing"),
    "NOT_PROMOTED": Code(INFO, "shard", "the shard failed the check and was left where it is",
                         "fix the findings and check again"),
    "PROMOTION_REFUSED": Code(ERROR, "shard", "promotion refused before anything was touched: a shard "
                              "exists at the destination (without --replace), the files changed since they "
                              "were checked, --link across filesystems, or two shards of the run share a name",
                              "pass --replace, check again, or promote without --link"),
    "PROMOTION_FAILED": Code(ERROR, "shard", "placing or renaming the files failed (I/O error, hard "
                             "links unsupported with --link); nothing that opens was left at the destination",
                             "fix the cause and retry"),
    # ---- sets (appended)
    "SET_INCOMPLETE": Code(ERROR, "shard", "the shards given (a directory, glob or manifest; for --promote, "
                           "everything given) hold part of a shard set: a member is missing or given twice",
                           "give every shard of the set (its manifest BASE.json, or its directory), or "
                           "name a shard's prefix alone to check just that shard"),
    # ---- promotion: what travels with a set, and the destination read back (appended)
    "TRAVELLER_INVALID": Code(ERROR, "shard", "a file that travels with the shard (a balanced order) is not "
                              "whole (its own CRC-32s and step denominators), is not the order its manifest "
                              "records, is not these shards' order (a pack's cost or trained tokens, recomputed "
                              "from the shards, differ), or is missing though the manifest records it: refused "
                              "before anything moved",
                              "re-plan the order (--balance-for, or plan-batches --out) and check again"),
    "DESTINATION_INCOMPLETE": Code(ERROR, "shard", "after promotion the destination, read back, is not whole: "
                                   "a shard's file, an order or a manifest is missing or differs, or an old "
                                   "file the new generation does not bring is left; the sources were kept",
                                   "fix the cause (storage, permissions) and promote again with --replace"),
    # ---- consumers (appended)
    "BRIDGE_ALIGNMENT_PADDING_TRAINED": Code(WARNING, ".loss.bin", "a pack written by Megatron-Bridge's packer "
                                             "(converted from its .npy/Parquet) stores loss 1 on EOS alignment "
                                             "padding (context-parallel padding past a sequence's last real "
                                             "token): Bridge 0.6 zeroed it at collate, Bridge main trains it",
                                             "train with bridge_semantics='0.6' to keep 0.6's loss, or fix the "
                                             "mask at the source (Bridge's prompt-template packer with "
                                             "pad_seq_to_mult > 1) and re-pack; inspect-idx --consumers counts it"),
    # ---- the padding a shard records (appended)
    "PAD_MULTIPLE_BELOW_PARALLELISM": Code(ERROR, ".seq.idx", "the metadata pad_seq_to_mult is not a multiple of "
                                           "the one its recorded parallelism needs (CP, TP, SP and FP8 recipe: "
                                           "docs/FORMAT.md \"FP8 alignment\"): the shard claims a layout its "
                                           "sequences were not padded for",
                                           "re-pack with the --cp/--tp/--sp/--fp8 the metadata records "
                                           "(repack-sft), or fix the producer's metadata"),
}

#: Each pack invariant's finding code.
RULE_CODES: Dict[Rule, str] = {
    Rule.PACK_EMPTY: "PACK_EMPTY",
    Rule.PACK_TOO_LONG: "PACK_TOO_LONG",
    Rule.LENGTH_MISMATCH: "LOSS_LENGTH_MISMATCH",
    Rule.LOSS_VALUE: "LOSS_NOT_BINARY",
    Rule.LOSS_ON_LAST: "LOSS_ON_LAST_POSITION",
    Rule.SEQ_NONE: "SEQ_NONE",
    Rule.SEQ_FIRST_NOT_ZERO: "SEQ_FIRST_NOT_ZERO",
    Rule.SEQ_NOT_INCREASING: "SEQ_NOT_INCREASING",
    Rule.SEQ_START_OUT_OF_RANGE: "SEQ_START_OUT_OF_RANGE",
    Rule.SEQ_NOT_PAD_MULTIPLE: "SEQ_NOT_PAD_MULTIPLE",
    Rule.TOKEN_NEGATIVE: "TOKEN_NEGATIVE",
    Rule.TOKEN_TOO_LARGE: "TOKEN_TOO_LARGE",
    Rule.TOKEN_OUT_OF_VOCAB: "TOKEN_OUT_OF_VOCAB",
}
