// sft_idx_json.cpp -- the metadata: strict UTF-8, a small RFC 8259 JSON parser, and
// the required keys of FORMAT.md "Metadata". Unknown keys are parsed (so the whole
// document must be valid JSON) and ignored; a duplicate key keeps its last value.
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

// Deep enough for any real metadata, shallow enough for the stack.
constexpr int kMaxDepth = 256;

struct Json {
  enum Kind { Null, Bool, Int, Float, String, Array, Object } kind = Null;
  bool boolean = false;
  int64_t integer = 0;
  bool int_overflow = false;  // an integer literal outside int64
  double number = 0.0;
  std::string text;
  std::vector<std::string> keys;   // Object: keys[k] -> values[k]
  std::vector<Json> values;        // Object values or Array items

  const Json* get(std::string_view key) const {
    for (size_t k = keys.size(); k-- > 0;)
      if (keys[k] == key) return &values[k];
    return nullptr;
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

class Parser {
 public:
  explicit Parser(std::string_view s) : s_(s) {}

  // Parses one value followed only by whitespace; on failure *error says where.
  bool parse_document(Json* out, std::string* error) {
    skip_ws();
    if (!value(out, 0)) { *error = error_; return false; }
    skip_ws();
    if (pos_ != s_.size()) { *error = at("extra data after the JSON value"); return false; }
    return true;
  }

 private:
  std::string_view s_;
  size_t pos_ = 0;
  std::string error_;

  std::string at(const std::string& what) const { return what + " at byte " + to_str(pos_); }
  bool fail(const std::string& what) {
    if (error_.empty()) error_ = at(what);
    return false;
  }
  void skip_ws() {
    while (pos_ < s_.size() && (s_[pos_] == ' ' || s_[pos_] == '\t' || s_[pos_] == '\n' || s_[pos_] == '\r')) ++pos_;
  }
  bool literal(std::string_view word) {
    if (s_.substr(pos_, word.size()) != word) return fail("invalid literal");
    pos_ += word.size();
    return true;
  }

  bool value(Json* out, int depth) {
    if (depth > kMaxDepth) return fail("nesting deeper than " + to_str(kMaxDepth));
    if (pos_ >= s_.size()) return fail("unexpected end of input");
    const char c = s_[pos_];
    switch (c) {
      case '{': return object(out, depth);
      case '[': return array(out, depth);
      case '"': out->kind = Json::String; return string(&out->text);
      case 't': out->kind = Json::Bool; out->boolean = true; return literal("true");
      case 'f': out->kind = Json::Bool; out->boolean = false; return literal("false");
      case 'n': out->kind = Json::Null; return literal("null");
      default:
        if (c == '-' || (c >= '0' && c <= '9')) return number(out);
        return fail("unexpected character");
    }
  }

  bool object(Json* out, int depth) {
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
      Json item;
      if (!value(&item, depth + 1)) return false;
      out->keys.push_back(std::move(key));
      out->values.push_back(std::move(item));
      skip_ws();
      if (pos_ < s_.size() && s_[pos_] == ',') { ++pos_; continue; }
      if (pos_ < s_.size() && s_[pos_] == '}') { ++pos_; return true; }
      return fail("expected ',' or '}'");
    }
  }

  bool array(Json* out, int depth) {
    out->kind = Json::Array;
    ++pos_;
    skip_ws();
    if (pos_ < s_.size() && s_[pos_] == ']') { ++pos_; return true; }
    for (;;) {
      skip_ws();
      Json item;
      if (!value(&item, depth + 1)) return false;
      out->values.push_back(std::move(item));
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

  bool string(std::string* out) {
    ++pos_;  // opening quote
    for (;;) {
      if (pos_ >= s_.size()) return fail("unterminated string");
      const unsigned char c = static_cast<unsigned char>(s_[pos_]);
      if (c == '"') { ++pos_; return true; }
      if (c < 0x20) return fail("control character in string");
      if (c != '\\') { out->push_back(char(c)); ++pos_; continue; }
      if (++pos_ >= s_.size()) return fail("unterminated escape");
      const char e = s_[pos_++];
      switch (e) {
        case '"': out->push_back('"'); break;
        case '\\': out->push_back('\\'); break;
        case '/': out->push_back('/'); break;
        case 'b': out->push_back('\b'); break;
        case 'f': out->push_back('\f'); break;
        case 'n': out->push_back('\n'); break;
        case 'r': out->push_back('\r'); break;
        case 't': out->push_back('\t'); break;
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
      const auto r = std::from_chars(first, last, out->integer);
      out->int_overflow = r.ec != std::errc();
      return true;
    }
    out->kind = Json::Float;
    const auto r = std::from_chars(first, last, out->number);
    if (r.ec == std::errc::result_out_of_range) {
      // Python parses it too (to inf or 0.0); only the magnitude is lost.
      out->number = (*first == '-') ? -HUGE_VAL : HUGE_VAL;
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

  // A non-bool JSON integer (optionally null); `min` is the least value allowed.
  std::optional<int64_t> integer(const Json* v, const std::string& key, bool nullable, int64_t min) {
    if (v == nullptr) { invalid(key, "present", "is missing"); return std::nullopt; }
    if (v->kind == Json::Null && nullable) return std::nullopt;
    if (v->kind != Json::Int) { invalid(key, nullable ? "int or null" : "int", "has the wrong type"); return std::nullopt; }
    if (v->int_overflow) { invalid(key, "an int64", "is out of range"); return std::nullopt; }
    if (v->integer < min) { invalid(key, ">= " + to_str_i(min), "is " + to_str_i(v->integer)); return std::nullopt; }
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
      auto v = integer(s->get(f.name), std::string("stats.") + f.name, false, INT64_MIN);
      if (v) *f.dst = *v;
    }
    if (s->get("min_packed_runtime_len") != nullptr)  // format 1.1
      out->min_packed_runtime_len = integer(s->get("min_packed_runtime_len"), "stats.min_packed_runtime_len", true,
                                            INT64_MIN);
    out->packing_factor = ratio(s->get("packing_factor"), "stats.packing_factor", false).value_or(0.0);
    out->packing_efficiency = ratio(s->get("packing_efficiency"), "stats.packing_efficiency", true);
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
  if (!Parser(json).parse_document(&root, &error)) return unparsable(error);
  if (root.kind != Json::Object) return unparsable("the top-level value is not an object");

  KeyChecker c(root, sink, where);
  Metadata m;
  c.string_in("format", {"megatron_sft_idx"});
  m.pack_size = c.integer(root.get("pack_size"), "pack_size", true, 1);
  m.token_dtype = c.string_in("token_dtype", {"uint16", "int32"});
  m.vocab_size = c.integer(root.get("vocab_size"), "vocab_size", true, 1);
  m.loss_mask_convention = c.string_in("loss_mask_convention", {"label_aligned"});
  m.pad_seq_to_mult = c.integer(root.get("pad_seq_to_mult"), "pad_seq_to_mult", false, 1).value_or(1);
  if (root.get("pad_layout") != nullptr)  // format 1.1; absent means "stored"
    m.pad_offset = c.string_in("pad_layout", {"stored", "runtime"}) == "runtime" ? 1 : 0;
  if (const Json* s = c.object(root.get("stats"), "stats")) c.stats(s, &m.stats);
  if (const Json* files = c.object(root.get("files"), "files")) {
    for (int k = 0; k < 4; ++k) {
      const std::string key = std::string("files.") + kChecksummed[k];
      const Json* entry = c.object(files->get(kChecksummed[k]), key);
      if (entry == nullptr) continue;
      auto size = c.integer(entry->get("size"), key + ".size", false, 0);
      auto crc = c.integer(entry->get("crc32"), key + ".crc32", false, 0);
      m.files[k].size = uint64_t(size.value_or(0));
      m.files[k].crc32 = uint64_t(crc.value_or(0));
    }
  }
  c.object(root.get("producer"), "producer");
  for (const char* key : {"tokenizer", "packing", "parallelism", "source", "extra"}) {
    const Json* v = root.get(key);
    if (v != nullptr && v->kind != Json::Null && v->kind != Json::Object) c.invalid(key, "object", "is not an object");
  }
  if (!c.ok) return std::nullopt;
  return m;
}

}  // namespace detail
}  // namespace sft_idx
