// Saves one tensor through an installed libflashckpt and restores it: consumer SOCKET JOB.
// Prints "restored step 7: 4096 floats equal" and exits 0, or says what failed and exits 1.
#include <flashckpt/client.h>

#include <chrono>
#include <cstdio>
#include <vector>

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: consumer SOCKET JOB\n");
    return 2;
  }
  using namespace std::chrono_literals;
  flashckpt::ClientOptions options;
  options.socket_path = argv[1];
  options.job = argv[2];
  auto client = flashckpt::Client::Connect(options);
  if (!client.ok()) {
    std::fprintf(stderr, "connect: %s\n", client.status().ToString().c_str());
    return 1;
  }
  flashckpt::Client& c = **client;
  constexpr uint64_t n = 4096;
  flashckpt::TensorSpec spec;
  spec.name = "w";
  spec.shape = {n};
  if (auto s = c.Register(flashckpt::Topology{}, {spec}); !s.ok()) {
    std::fprintf(stderr, "register: %s\n", s.ToString().c_str());
    return 1;
  }
  std::vector<float> w(n);
  for (uint64_t i = 0; i < n; ++i) w[i] = static_cast<float>(i) * 0.5f;
  auto snap = c.Snapshot(7, {{"w", w.data(), n * 4}}, {});
  if (!snap.ok()) {
    std::fprintf(stderr, "snapshot: %s\n", snap.status().ToString().c_str());
    return 1;
  }
  if (auto s = c.WaitComplete(7, 30s); !s.ok()) {
    std::fprintf(stderr, "wait: %s\n", s.ToString().c_str());
    return 1;
  }
  std::vector<float> back(n, -1.f);
  auto restored = c.Restore(std::nullopt, {{"w", back.data(), n * 4}}, 30s);
  if (!restored.ok() || !restored->found) {
    std::fprintf(stderr, "restore: %s\n", restored.ok() ? "no checkpoint" : restored.status().ToString().c_str());
    return 1;
  }
  if (back != w) {
    std::fprintf(stderr, "restore: the restored floats differ from the saved ones\n");
    return 1;
  }
  std::printf("restored step %lld: %llu floats equal\n", static_cast<long long>(restored->step),
              static_cast<unsigned long long>(n));
  return 0;
}
