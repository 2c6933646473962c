// libFuzzer target: saved_signal_<rank> files are read back from the checkpoint directory, so their
// bytes are untrusted. The input is a whole signal file. Properties: the parser never crashes, every
// name it accepts is a plain name, and what it accepts survives EncodeSignal and a second parse.
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
  return 0;
}
