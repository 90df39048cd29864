// sft_idx_check -- the native promotion gate for megatron_sft_idx shards.
//
//   sft_idx_check PREFIX... [--no-checksums] [--json] [--vocab-size N] [--max-findings N]
//
// One line per finding on stdout, then one verdict line per shard (or one JSON
// document with --json). Exit status: 0 every shard passed, 1 a shard failed,
// 2 usage error or unreadable input (no file at a prefix, a file cannot be mapped).
#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "sft_idx.hpp"

namespace {

constexpr int kExitOk = 0, kExitFail = 1, kExitUsage = 2;

const char* const kUsage =
    "usage: sft_idx_check PREFIX... [--no-checksums] [--json] [--vocab-size N] [--max-findings N]\n"
    "Check megatron_sft_idx shards (native implementation of docs/FORMAT.md).\n"
    "  --no-checksums    skip the CRC-32 pass over .bin/.idx/.loss.bin/.seq.bin\n"
    "  --json            print one JSON document instead of text\n"
    "  --vocab-size N    every token id must be < N (default: the metadata's vocab_size)\n"
    "  --max-findings N  findings listed per shard (default 200; all are counted)\n"
    "Exit status: 0 pass, 1 fail, 2 usage error or unreadable input.\n";

struct Args {
  std::vector<std::string> prefixes;
  bool json = false;
  sft_idx::ValidateOptions options;
};

bool parse_positive(const char* text, long long* out) {
  errno = 0;
  char* end = nullptr;
  const long long v = std::strtoll(text, &end, 10);
  if (errno != 0 || end == text || *end != '\0' || v <= 0) return false;
  *out = v;
  return true;
}

// Returns -1 when the arguments are good, else the exit status to return.
int parse_args(int argc, char** argv, Args* args) {
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "-h" || a == "--help") {
      std::fputs(kUsage, stdout);
      return kExitOk;
    } else if (a == "--no-checksums") {
      args->options.checksums = false;
    } else if (a == "--json") {
      args->json = true;
    } else if (a == "--vocab-size" || a == "--max-findings") {
      long long v = 0;
      if (i + 1 >= argc || !parse_positive(argv[i + 1], &v) || v > INT32_MAX) {  // FORMAT.md "Limits"
        std::fprintf(stderr, "sft_idx_check: error: %s needs an integer in 1..2147483647\n%s", a.c_str(), kUsage);
        return kExitUsage;
      }
      ++i;
      if (a == "--vocab-size") args->options.vocab_size = v;
      else args->options.max_findings = size_t(v);
    } else if (a.size() > 1 && a[0] == '-') {
      std::fprintf(stderr, "sft_idx_check: error: unknown option %s\n%s", a.c_str(), kUsage);
      return kExitUsage;
    } else {
      args->prefixes.push_back(a);
    }
  }
  if (args->prefixes.empty()) {
    std::fprintf(stderr, "sft_idx_check: error: give at least one PREFIX\n%s", kUsage);
    return kExitUsage;
  }
  return -1;
}

std::string json_string(const std::string& s) {
  std::string out = "\"";
  for (const unsigned char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      default:
        if (c < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", c);
          out += buf;
        } else {
          out.push_back(char(c));  // paths may hold any bytes; the rest is ASCII
        }
    }
  }
  return out + "\"";
}

const char* verdict_name(sft_idx::Verdict v) {
  return v == sft_idx::Verdict::pass ? "pass" : v == sft_idx::Verdict::fail ? "fail" : "unreadable";
}

void print_text(const sft_idx::Report& r) {
  for (const sft_idx::Finding& f : r.findings) {
    std::string where = f.file;
    if (f.pack >= 0) where += ", pack " + std::to_string(f.pack);
    if (f.offset >= 0) where += ", byte " + std::to_string(f.offset);
    std::printf("%s %-7s %-26s %s: %s\n", r.prefix.c_str(), sft_idx::severity_name(f.severity), f.code.c_str(),
                where.c_str(), f.message.c_str());
  }
  if (r.total_findings > r.findings.size()) {
    std::printf("%s info    %-26s %llu more findings not listed (--max-findings)\n", r.prefix.c_str(),
                "FINDINGS_TRUNCATED", (unsigned long long)(r.total_findings - r.findings.size()));
  }
  const char* verdict = r.verdict == sft_idx::Verdict::pass ? "PASS" : r.verdict == sft_idx::Verdict::fail
                                                                         ? "FAIL" : "UNREADABLE";
  std::printf("%s %s: %llu error(s)\n", r.prefix.c_str(), verdict, (unsigned long long)r.errors);
}

void print_json(const std::vector<sft_idx::Report>& reports, int status) {
  std::string out = "{\"schema\":\"megatron_sft_idx.native_check/1\",\"exit_code\":" + std::to_string(status) +
                    ",\"passed\":" + (status == kExitOk ? "true" : "false") + ",\"shards\":[";
  for (size_t k = 0; k < reports.size(); ++k) {
    const sft_idx::Report& r = reports[k];
    out += k ? "," : "";
    out += "{\"prefix\":" + json_string(r.prefix) + ",\"verdict\":\"" + verdict_name(r.verdict) +
           "\",\"errors\":" + std::to_string(r.errors) + ",\"total_findings\":" + std::to_string(r.total_findings) +
           ",\"findings\":[";
    for (size_t j = 0; j < r.findings.size(); ++j) {
      const sft_idx::Finding& f = r.findings[j];
      out += j ? "," : "";
      out += "{\"code\":" + json_string(f.code) + ",\"rule\":" + std::to_string(int(f.rule)) +
             ",\"severity\":\"" + sft_idx::severity_name(f.severity) + "\",\"file\":" + json_string(f.file) +
             ",\"pack\":" + (f.pack >= 0 ? std::to_string(f.pack) : "null") +
             ",\"offset\":" + (f.offset >= 0 ? std::to_string(f.offset) : "null") +
             ",\"message\":" + json_string(f.message) + "}";
    }
    out += "]}";
  }
  out += "]}\n";
  std::fputs(out.c_str(), stdout);
}

}  // namespace

int main(int argc, char** argv) {
  Args args;
  const int early = parse_args(argc, argv, &args);
  if (early >= 0) return early;
  std::vector<sft_idx::Report> reports;
  bool unreadable = false, failed = false;
  try {
    for (const std::string& prefix : args.prefixes) {
      reports.push_back(sft_idx::validate(prefix, args.options));
      unreadable |= reports.back().verdict == sft_idx::Verdict::unreadable;
      failed |= reports.back().verdict != sft_idx::Verdict::pass;
      if (!args.json) print_text(reports.back());
    }
  } catch (const std::bad_alloc&) {
    std::fputs("sft_idx_check: error: out of memory\n", stderr);
    return kExitUsage;
  }
  const int status = unreadable ? kExitUsage : failed ? kExitFail : kExitOk;
  if (args.json) print_json(reports, status);
  std::fflush(stdout);
  return status;
}
