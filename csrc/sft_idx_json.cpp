// sft_idx_json.cpp -- the metadata: strict UTF-8, a small RFC 8259 JSON parser, and
// the required keys of FORMAT.md "Metadata". Unknown keys are parsed (so the whole
// document must be valid JSON within FORMAT.md "Limits") and ignored; a duplicate key
// keeps its last value. Only the values the required-key checks read are stored.
#include <charconv>
#include <cmath>
#include <climits>
#include <initializer_list>
#include <optional>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "sft_idx_internal.hpp"

namespace sft_idx {
namespace detail {
namespace {

// Which members of an object the parser keeps (everything is parsed and checked against
// the limits; only what the required-key checks read is stored, so memory stays small
// whatever the document holds).
// Sources: the items of the "sources" array (format 1.2), each a SourceEntry.
enum class Want { None, Root, Stats, Files, FileEntry, Set, Text, Sources, SourceEntry };  // Text: a string to keep

constexpr const char* kRootKeys[] = {"format", "pack_size", "token_dtype", "vocab_size", "loss_mask_convention",
                                     "pad_seq_to_mult", "pad_layout", "stats", "files", "producer", "tokenizer",
                                     "packing", "parallelism", "source", "extra", "set", "sources"};
constexpr const char* kStatKeys[] = {"pack_count", "sequence_count", "token_count", "loss_token_count",
                                     "max_samples_per_bin", "dataset_max_seqlen", "min_seqlen",
                                     "min_packed_seqlen", "max_packed_seqlen", "packing_factor",
                                     "packing_efficiency", "min_packed_runtime_len"};
constexpr const char* kFileEntryKeys[] = {"size", "crc32"};
constexpr const char* kSetKeys[] = {"id", "name", "index", "count"};
constexpr const char* kSourceKeys[] = {"name", "sequences"};

template <size_t N>
bool one_of(std::string_view key, const char* const (&names)[N]) {
  for (const char* n : names)
    if (key == n) return true;
  return false;
}

// Whether an object member is kept, and what its own members are wanted for.
bool keep_member(Want want, std::string_view key, Want* child) {
  *child = Want::None;
  switch (want) {
    case Want::Root:
      *child = key == "stats" ? Want::Stats : key == "files" ? Want::Files : key == "set" ? Want::Set
             : key == "sources" ? Want::Sources : Want::None;
      return one_of(key, kRootKeys);
    case Want::Stats: return one_of(key, kStatKeys);
    case Want::Files: *child = Want::FileEntry; return one_of(key, kChecksummed);
    case Want::FileEntry: return one_of(key, kFileEntryKeys);
    case Want::Set: *child = Want::Text; return one_of(key, kSetKeys);
    case Want::SourceEntry: *child = Want::Text; return one_of(key, kSourceKeys);
    case Want::Sources: return false;  // an array: its items are kept by array()
    case Want::Text: return false;
    case Want::None: return false;
  }
  return false;
}

struct Json {
  enum Kind { Null, Bool, Int, Float, String, Array, Object } kind = Null;
  bool boolean = false;
  int64_t integer = 0;
  double number = 0.0;
  std::string text;
  std::vector<std::string> keys;   // Object: keys[k] -> values[k] (kept members only, unique)
  std::vector<Json> values;

  const Json* get(std::string_view key) const {
    for (size_t k = 0; k < keys.size(); ++k)
      if (keys[k] == key) return &values[k];
    return nullptr;
  }
  void put(std::string key, Json value) {  // a duplicate key keeps its last value
    for (size_t k = 0; k < keys.size(); ++k)
      if (keys[k] == key) { values[k] = std::move(value); return; }
    keys.push_back(std::move(key));
    values.push_back(std::move(value));
  }
};

// Returns the byte offset of the first invalid UTF-8 sequence, or -1.
int64_t invalid_utf8_at(std::string_view s) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  const size_t n = s.size();
  size_t i = 0;
  while (i < n) {
    const unsigned c = p[i];
    if (c < 0x80) { ++i; continue; }
    size_t len;
    uint32_t cp;
    if ((c & 0xE0) == 0xC0) { len = 2; cp = c & 0x1F; }
    else if ((c & 0xF0) == 0xE0) { len = 3; cp = c & 0x0F; }
    else if ((c & 0xF8) == 0xF0) { len = 4; cp = c & 0x07; }
    else return int64_t(i);
    if (i + len > n) return int64_t(i);
    for (size_t k = 1; k < len; ++k) {
      if ((p[i + k] & 0xC0) != 0x80) return int64_t(i);
      cp = cp << 6 | (p[i + k] & 0x3F);
    }
    const uint32_t min_cp = len == 2 ? 0x80 : len == 3 ? 0x800 : 0x10000;
    if (cp < min_cp || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return int64_t(i);
    i += len;
  }
  return -1;
}

// Whether a decimal literal that std::from_chars found out of range overflows (true) or
// underflows (false): the sign of the decimal exponent of its leading non-zero digit.
bool decimal_overflows(std::string_view lit) {
  size_t i = (!lit.empty() && lit[0] == '-') ? 1 : 0;
  int64_t digits = 0, int_digits = -1, lead = -1;  // lead: index of the first non-zero digit
  for (; i < lit.size() && lit[i] != 'e' && lit[i] != 'E'; ++i) {
    if (lit[i] == '.') { int_digits = digits; continue; }
    if (lit[i] != '0' && lead < 0) lead = digits;
    ++digits;
  }
  if (int_digits < 0) int_digits = digits;
  int64_t exponent = 0;
  bool negative = false;
  if (i < lit.size()) {
    ++i;
    if (i < lit.size() && (lit[i] == '+' || lit[i] == '-')) negative = lit[i++] == '-';
    for (; i < lit.size(); ++i)  // saturates: any exponent this large is out of range anyway
      if (exponent < (int64_t{1} << 40)) exponent = exponent * 10 + (lit[i] - '0');
  }
  if (lead < 0) return false;  // zero is never out of range
  return (negative ? -exponent : exponent) + int_digits - 1 - lead >= 0;
}

class Parser {
 public:
  explicit Parser(std::string_view s) : s_(s) {}

  // Parses one value followed only by whitespace; on failure *error says where and
  // limit_exceeded() tells a limit (FORMAT.md "Limits") from a syntax error.
  bool parse_document(Json* out, std::string* error) {
    skip_ws();
    if (!value(out, 0, Want::Root)) { *error = error_; return false; }
    skip_ws();
    if (pos_ != s_.size()) { *error = at("extra data after the JSON value"); return false; }
    return true;
  }
  bool limit_exceeded() const noexcept { return limit_; }

 private:
  std::string_view s_;
  size_t pos_ = 0;
  std::string error_;
  bool limit_ = false;

  std::string at(const std::string& what) const { return what + " at byte " + to_str(pos_); }
  bool fail(const std::string& what) {
    if (error_.empty()) error_ = at(what);
    return false;
  }
  bool over_limit(const std::string& what) {
    if (error_.empty()) limit_ = true;
    return fail(what);
  }
  void skip_ws() {
    while (pos_ < s_.size() && (s_[pos_] == ' ' || s_[pos_] == '\t' || s_[pos_] == '\n' || s_[pos_] == '\r')) ++pos_;
  }
  bool literal(std::string_view word) {
    if (s_.substr(pos_, word.size()) != word) return fail("invalid literal");
    pos_ += word.size();
    return true;
  }

  // `depth`: containers enclosing this value (0 for the top-level value).
  bool value(Json* out, int depth, Want want) {
    if (pos_ >= s_.size()) return fail("unexpected end of input");
    const char c = s_[pos_];
    if ((c == '{' || c == '[') && depth + 1 > int(kMaxMetadataDepth))
      return over_limit("containers nested deeper than " + to_str(kMaxMetadataDepth));
    switch (c) {
      case '{': return object(out, depth + 1, want);
      case '[': return array(out, depth + 1, want);
      case '"':  // kept values only: top-level members and the strings of kept objects (set.id)
        out->kind = Json::String;
        return string(depth <= 1 || want == Want::Text ? &out->text : nullptr);
      case 't': out->kind = Json::Bool; out->boolean = true; return literal("true");
      case 'f': out->kind = Json::Bool; out->boolean = false; return literal("false");
      case 'n': out->kind = Json::Null; return literal("null");
      default:
        if (c == '-' || (c >= '0' && c <= '9')) return number(out);
        return fail("unexpected character");
    }
  }

  // `depth`: this container's own depth (1 for the top-level object).
  bool object(Json* out, int depth, Want want) {
    out->kind = Json::Object;
    ++pos_;
    skip_ws();
    if (pos_ < s_.size() && s_[pos_] == '}') { ++pos_; return true; }
    for (;;) {
      skip_ws();
      if (pos_ >= s_.size() || s_[pos_] != '"') return fail("expected a string key");
      std::string key;
      if (!string(&key)) return false;
      skip_ws();
      if (pos_ >= s_.size() || s_[pos_] != ':') return fail("expected ':'");
      ++pos_;
      skip_ws();
      Want child = Want::None;
      const bool keep = keep_member(want, key, &child);
      Json item;
      if (!value(&item, depth, child)) return false;
      if (keep) out->put(std::move(key), std::move(item));
      skip_ws();
      if (pos_ < s_.size() && s_[pos_] == ',') { ++pos_; continue; }
      if (pos_ < s_.size() && s_[pos_] == '}') { ++pos_; return true; }
      return fail("expected ',' or '}'");
    }
  }

  // Items are checked and dropped, but those of "sources" (format 1.2), kept in `values`.
  bool array(Json* out, int depth, Want want) {
    out->kind = Json::Array;
    ++pos_;
    skip_ws();
    if (pos_ < s_.size() && s_[pos_] == ']') { ++pos_; return true; }
    const bool keep = want == Want::Sources;
    for (;;) {
      skip_ws();
      Json item;
      if (!value(&item, depth, keep ? Want::SourceEntry : Want::None)) return false;
      if (keep) out->values.push_back(std::move(item));
      skip_ws();
      if (pos_ < s_.size() && s_[pos_] == ',') { ++pos_; continue; }
      if (pos_ < s_.size() && s_[pos_] == ']') { ++pos_; return true; }
      return fail("expected ',' or ']'");
    }
  }

  bool hex4(uint32_t* out) {
    if (pos_ + 4 > s_.size()) return fail("truncated \\u escape");
    uint32_t v = 0;
    for (int k = 0; k < 4; ++k) {
      const char h = s_[pos_++];
      v <<= 4;
      if (h >= '0' && h <= '9') v |= uint32_t(h - '0');
      else if (h >= 'a' && h <= 'f') v |= uint32_t(h - 'a' + 10);
      else if (h >= 'A' && h <= 'F') v |= uint32_t(h - 'A' + 10);
      else return fail("bad hex digit in \\u escape");
    }
    *out = v;
    return true;
  }

  static void put_utf8(std::string* out, uint32_t cp) {
    if (out == nullptr) return;
    if (cp < 0x80) { out->push_back(char(cp)); return; }
    if (cp < 0x800) { out->push_back(char(0xC0 | cp >> 6)); }
    else if (cp < 0x10000) { out->push_back(char(0xE0 | cp >> 12)); out->push_back(char(0x80 | (cp >> 6 & 0x3F))); }
    else {
      out->push_back(char(0xF0 | cp >> 18));
      out->push_back(char(0x80 | (cp >> 12 & 0x3F)));
      out->push_back(char(0x80 | (cp >> 6 & 0x3F)));
    }
    out->push_back(char(0x80 | (cp & 0x3F)));
  }

  // Reads a string into *out (nullptr: checked and dropped).
  bool string(std::string* out) {
    ++pos_;  // opening quote
    auto put = [out](char ch) { if (out != nullptr) out->push_back(ch); };
    for (;;) {
      if (pos_ >= s_.size()) return fail("unterminated string");
      const unsigned char c = static_cast<unsigned char>(s_[pos_]);
      if (c == '"') { ++pos_; return true; }
      if (c < 0x20) return fail("control character in string");
      if (c != '\\') { put(char(c)); ++pos_; continue; }
      if (++pos_ >= s_.size()) return fail("unterminated escape");
      const char e = s_[pos_++];
      switch (e) {
        case '"': put('"'); break;
        case '\\': put('\\'); break;
        case '/': put('/'); break;
        case 'b': put('\b'); break;
        case 'f': put('\f'); break;
        case 'n': put('\n'); break;
        case 'r': put('\r'); break;
        case 't': put('\t'); break;
        case 'u': {
          uint32_t cp;
          if (!hex4(&cp)) return false;
          if (cp >= 0xD800 && cp <= 0xDBFF && s_.substr(pos_, 2) == "\\u") {
            const size_t save = pos_;
            pos_ += 2;
            uint32_t low;
            if (!hex4(&low)) return false;
            if (low >= 0xDC00 && low <= 0xDFFF) cp = 0x10000 + ((cp - 0xD800) << 10) + (low - 0xDC00);
            else pos_ = save;  // a lone high surrogate; the next escape is read on its own
          }
          // JSON admits lone surrogates; they cannot be UTF-8, so keep U+FFFD in their place.
          put_utf8(out, (cp >= 0xD800 && cp <= 0xDFFF) ? 0xFFFD : cp);
          break;
        }
        default: return fail("invalid escape");
      }
    }
  }

  bool number(Json* out) {
    const size_t start = pos_;
    bool is_float = false;
    if (s_[pos_] == '-') ++pos_;
    if (pos_ >= s_.size()) return fail("truncated number");
    if (s_[pos_] == '0') {
      ++pos_;
    } else if (s_[pos_] >= '1' && s_[pos_] <= '9') {
      while (pos_ < s_.size() && s_[pos_] >= '0' && s_[pos_] <= '9') ++pos_;
    } else {
      return fail("invalid number");
    }
    if (pos_ < s_.size() && s_[pos_] == '.') {
      is_float = true;
      ++pos_;
      const size_t digits = pos_;
      while (pos_ < s_.size() && s_[pos_] >= '0' && s_[pos_] <= '9') ++pos_;
      if (pos_ == digits) return fail("digit expected after '.'");
    }
    if (pos_ < s_.size() && (s_[pos_] == 'e' || s_[pos_] == 'E')) {
      is_float = true;
      ++pos_;
      if (pos_ < s_.size() && (s_[pos_] == '+' || s_[pos_] == '-')) ++pos_;
      const size_t digits = pos_;
      while (pos_ < s_.size() && s_[pos_] >= '0' && s_[pos_] <= '9') ++pos_;
      if (pos_ == digits) return fail("digit expected in exponent");
    }
    const char* first = s_.data() + start;
    const char* last = s_.data() + pos_;
    if (!is_float) {
      out->kind = Json::Int;
      if (std::from_chars(first, last, out->integer).ec != std::errc())
        return over_limit("an integer of " + to_str(uint64_t(last - first)) + " characters is outside int64");
      return true;
    }
    out->kind = Json::Float;
    const auto r = std::from_chars(first, last, out->number);
    if (r.ec == std::errc::result_out_of_range) {
      if (decimal_overflows(std::string_view(first, size_t(last - first))))
        return over_limit("a number overflows a double");
      out->number = 0.0;  // underflow: Python parses it as 0.0 (or a subnormal) too
    }
    return true;
  }
};

// ---------------------------------------------------------------- required keys

class KeyChecker {
 public:
  KeyChecker(const Json& root, Sink& sink, const Context& ctx) : root_(root), sink_(sink), ctx_(ctx) {}
  bool ok = true;

  void invalid(const std::string& key, const std::string& expected, const std::string& what) {
    ok = false;
    sink_.add(make_finding("METADATA_INVALID", ctx_, kSeqIdx, "metadata key '" + key + "' " + what,
                           {key, expected, ""}, int64_t(kMetadataOffset)));
  }

  // A non-bool JSON integer (optionally null) in [range.min, range.max] (FORMAT.md "Limits").
  std::optional<int64_t> integer(const Json* v, const std::string& key, bool nullable, IntRange range) {
    if (v == nullptr) { invalid(key, "present", "is missing"); return std::nullopt; }
    if (v->kind == Json::Null && nullable) return std::nullopt;
    if (v->kind != Json::Int) { invalid(key, nullable ? "int or null" : "int", "has the wrong type"); return std::nullopt; }
    if (v->integer < range.min || v->integer > range.max) {
      invalid(key, to_str_i(range.min) + ".." + to_str_i(range.max), "is out of range: " + to_str_i(v->integer));
      return std::nullopt;
    }
    return v->integer;
  }

  const Json* object(const Json* v, const std::string& key) {
    if (v == nullptr) { invalid(key, "present", "is missing"); return nullptr; }
    if (v->kind != Json::Object) { invalid(key, "object", "has the wrong type"); return nullptr; }
    return v;
  }

  std::string string_in(const std::string& key, std::initializer_list<const char*> allowed) {
    const Json* v = root_.get(key);
    std::string expected;
    for (const char* a : allowed) expected += (expected.empty() ? "" : " or ") + std::string("\"") + a + "\"";
    if (v == nullptr) { invalid(key, expected, "is missing"); return {}; }
    if (v->kind != Json::String) { invalid(key, expected, "has the wrong type"); return {}; }
    for (const char* a : allowed)
      if (v->text == a) return v->text;
    invalid(key, expected, "has an unknown value \"" + v->text.substr(0, 64) + "\"");
    return {};
  }

  void stats(const Json* s, Stats* out) {
    const struct { const char* name; int64_t* dst; } ints[] = {
        {"pack_count", &out->pack_count}, {"sequence_count", &out->sequence_count},
        {"token_count", &out->token_count}, {"loss_token_count", &out->loss_token_count},
        {"max_samples_per_bin", &out->max_samples_per_bin}, {"dataset_max_seqlen", &out->dataset_max_seqlen},
        {"min_seqlen", &out->min_seqlen}, {"min_packed_seqlen", &out->min_packed_seqlen},
        {"max_packed_seqlen", &out->max_packed_seqlen}};
    for (const auto& f : ints) {
      auto v = integer(s->get(f.name), std::string("stats.") + f.name, false, kStatRange);
      if (v) *f.dst = *v;
    }
    if (s->get("min_packed_runtime_len") != nullptr)  // format 1.1
      out->min_packed_runtime_len = integer(s->get("min_packed_runtime_len"), "stats.min_packed_runtime_len", true,
                                            kStatRange);
    out->packing_factor = ratio(s->get("packing_factor"), "stats.packing_factor", false).value_or(0.0);
    out->packing_efficiency = ratio(s->get("packing_efficiency"), "stats.packing_efficiency", true);
  }

  // FORMAT.md "Sets": id (and name, if present) a string of 1..kMaxSetText UTF-8 bytes,
  // count and index ints in their ranges, index < count.
  void shard_set(const Json* s) {
    for (const char* key : {"id", "name"}) {
      const Json* v = s->get(key);
      if (v == nullptr && std::string_view(key) == "name") continue;
      if (v != nullptr && v->kind == Json::Null && std::string_view(key) == "name") continue;
      if (v == nullptr || v->kind != Json::String || v->text.empty() || v->text.size() > kMaxSetText)
        invalid(std::string("set.") + key, "string of 1.." + to_str(kMaxSetText) + " bytes", "is not a short string");
    }
    auto count = integer(s->get("count"), "set.count", false, kSetCountRange);
    auto index = integer(s->get("index"), "set.index", false, kSetIndexRange);
    if (count && index && *index >= *count)
      invalid("set.index", "0.." + to_str_i(*count - 1), "is not below set.count");
  }

  // FORMAT.md "Metadata", 1.2: 1..65535 objects of distinct names (1..256 bytes) whose sequence
  // counts add up to the shard's.
  std::optional<std::vector<int64_t>> sources(const Json* v, int64_t sequence_count) {
    if (v->kind != Json::Array || v->values.empty() || v->values.size() > kMaxSources) {
      invalid("sources", "a list of 1.." + to_str(kMaxSources) + " sources", "is not");
      return std::nullopt;
    }
    std::vector<int64_t> counts;
    std::vector<std::string> names;
    int64_t total = 0;
    for (size_t k = 0; k < v->values.size(); ++k) {
      const std::string key = "sources[" + to_str(k) + "]";
      const Json& s = v->values[k];
      if (s.kind != Json::Object) { invalid(key, "object", "is not an object"); return std::nullopt; }
      const Json* name = s.get("name");
      if (name == nullptr || name->kind != Json::String || name->text.empty() || name->text.size() > kMaxSetText) {
        invalid(key + ".name", "string of 1.." + to_str(kMaxSetText) + " bytes", "is not a short string");
        return std::nullopt;
      }
      for (const std::string& seen : names)
        if (seen == name->text) { invalid("sources", "distinct names", "names a source twice"); return std::nullopt; }
      names.push_back(name->text);
      auto n = integer(s.get("sequences"), key + ".sequences", false, kStatRange);
      if (!n) return std::nullopt;
      counts.push_back(*n);
      if (__builtin_add_overflow(total, *n, &total)) {
        invalid("sources", "counts adding up within int64", "overflows");
        return std::nullopt;
      }
    }
    if (total != sequence_count) {
      invalid("sources", "sequences adding up to stats.sequence_count " + to_str_i(sequence_count),
              "adds up to " + to_str_i(total));
      return std::nullopt;
    }
    return counts;
  }

  std::optional<double> ratio(const Json* v, const std::string& key, bool nullable) {
    if (v == nullptr) { invalid(key, "number", "is missing"); return std::nullopt; }
    if (v->kind == Json::Null && nullable) return std::nullopt;
    if (v->kind == Json::Float) return v->number;
    if (v->kind == Json::Int) return double(v->integer);
    invalid(key, nullable ? "number or null" : "number", "has the wrong type");
    return std::nullopt;
  }

 private:
  const Json& root_;
  Sink& sink_;
  const Context& ctx_;
};

}  // namespace

std::optional<Metadata> parse_metadata(std::string_view json, const std::string& path, Sink& sink) {
  Context where;  // only for make_finding's file name
  where.path[kSeqIdx] = path;
  auto unparsable = [&](const std::string& why) {
    sink.add(make_finding("METADATA_UNPARSABLE", where, kSeqIdx, "metadata (" + to_str(json.size()) +
                          " bytes) is not valid UTF-8 JSON: " + why, {"metadata", "UTF-8 JSON object", ""},
                          int64_t(kMetadataOffset)));
    return std::nullopt;
  };
  const int64_t bad = invalid_utf8_at(json);
  if (bad >= 0) return unparsable("invalid UTF-8 at byte " + to_str_i(bad));
  Json root;
  std::string error;
  Parser parser(json);
  if (!parser.parse_document(&root, &error)) {
    if (!parser.limit_exceeded()) return unparsable(error);
    sink.add(make_finding("METADATA_LIMIT", where, kSeqIdx, "metadata exceeds the format's limits: " + error,
                          {"metadata", "FORMAT.md \"Limits\"", ""}, int64_t(kMetadataOffset)));
    return std::nullopt;
  }
  if (root.kind != Json::Object) return unparsable("the top-level value is not an object");

  KeyChecker c(root, sink, where);
  Metadata m;
  c.string_in("format", {"megatron_sft_idx"});
  m.pack_size = c.integer(root.get("pack_size"), "pack_size", true, kPackSizeRange);
  m.token_dtype = c.string_in("token_dtype", {"uint16", "int32"});
  m.vocab_size = c.integer(root.get("vocab_size"), "vocab_size", true, kVocabSizeRange);
  m.loss_mask_convention = c.string_in("loss_mask_convention", {"label_aligned"});
  m.pad_seq_to_mult = c.integer(root.get("pad_seq_to_mult"), "pad_seq_to_mult", false, kPadRange).value_or(1);
  if (root.get("pad_layout") != nullptr)  // format 1.1; absent means "stored"
    m.pad_offset = c.string_in("pad_layout", {"stored", "runtime"}) == "runtime" ? 1 : 0;
  if (const Json* s = c.object(root.get("stats"), "stats")) c.stats(s, &m.stats);
  if (const Json* files = c.object(root.get("files"), "files")) {
    for (int k = 0; k < 4; ++k) {
      const std::string key = std::string("files.") + kChecksummed[k];
      const Json* entry = c.object(files->get(kChecksummed[k]), key);
      if (entry == nullptr) continue;
      auto size = c.integer(entry->get("size"), key + ".size", false, kFileSizeRange);
      auto crc = c.integer(entry->get("crc32"), key + ".crc32", false, kCrcRange);
      m.files[k].size = uint64_t(size.value_or(0));
      m.files[k].crc32 = uint64_t(crc.value_or(0));
    }
  }
  c.object(root.get("producer"), "producer");
  for (const char* key : {"tokenizer", "packing", "parallelism", "source", "extra", "set"}) {
    const Json* v = root.get(key);
    if (v != nullptr && v->kind != Json::Null && v->kind != Json::Object) c.invalid(key, "object", "is not an object");
  }
  if (const Json* s = root.get("set"); s != nullptr && s->kind == Json::Object) c.shard_set(s);
  if (const Json* s = root.get("sources"); s != nullptr && s->kind != Json::Null)
    m.source_sequences = c.sources(s, m.stats.sequence_count);
  if (!c.ok) return std::nullopt;
  return m;
}

}  // namespace detail
}  // namespace sft_idx
