// libFuzzer target: saved_signal_<rank> files are read back from the checkpoint directory, so their
// bytes are untrusted. The input is a whole signal file. Properties: the parser never crashes, every
// name it accepts is a plain name, every header it accepts fits its file, and what it accepts survives EncodeSignal and a second parse.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "common/format/signal.h"
#include "fuzz_check.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace flashckpt;
  auto signal = ParseSignal(std::string_view(reinterpret_cast<const char*>(data), size));
  if (!signal.ok()) return 0;
  for (const auto& name : signal->files) {
    FUZZ_CHECK(!name.empty() && name != "." && name != "..");
    FUZZ_CHECK(name.find('/') == std::string::npos && name.find('\0') == std::string::npos);
  }
  auto again = ParseSignal(EncodeSignal("fuzz", *signal, 0));
  FUZZ_CHECK(again.ok());
  FUZZ_CHECK(again->rank == signal->rank && again->step == signal->step);
  FUZZ_CHECK(again->resumed_from == signal->resumed_from && again->run_id == signal->run_id);
  FUZZ_CHECK(again->files == signal->files);
  FUZZ_CHECK(again->headers.size() == signal->headers.size());
  for (size_t i = 0; i < signal->headers.size(); ++i) {
    const SignalHeader& a = signal->headers[i];
    const SignalHeader& b = again->headers[i];
    FUZZ_CHECK(a.file == b.file && a.header_bytes == b.header_bytes && a.file_bytes == b.file_bytes && a.json == b.json);
    FUZZ_CHECK(a.json.size() <= a.header_bytes && a.header_bytes + 8 <= a.file_bytes);
  }
  return 0;
}
