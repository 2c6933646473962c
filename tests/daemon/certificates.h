// Certificates made by openssl for the TLS tests of the replica listener and its services.
#pragma once

#include <stdlib.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include <openssl/crypto.h>

#include "daemon/replica/replica_server.h"

namespace flashckpt {

// gRPC's TLS runs on threads it does not join, and one may still be ending when a test's main
// returns. OpenSSL's exit handler would delete its per-thread keys first, and that thread's OpenSSL
// state (freed by the keys' destructors) would never be freed: LeakSanitizer reported it (3 objects
// from CRYPTO_zalloc, about 10 KB) in 1 run of a TLS test in 40. As flashckptd and the CLI do, the
// test binaries that make certificates run without that handler, set before main.
inline const int kOpenSslWithoutExitHandler = OPENSSL_init_crypto(OPENSSL_INIT_NO_ATEXIT, nullptr);

// Certificates made by openssl in a temporary directory: a CA, a server certificate for
// 127.0.0.1 (CN node-a), client certificates of CN node-b and intruder from the same CA, and one of
// CN node-b from another CA.
class Certificates {
 public:
  Certificates() {
    char tmpl[] = "/tmp/flashckpt-replica-certs-XXXXXX";
    if (::mkdtemp(tmpl) == nullptr) return;
    dir_ = tmpl;
    ok_ = Ca("ca") && Ca("other-ca") && Leaf("node-a", "ca", "subjectAltName=IP:127.0.0.1,DNS:node-a") &&
          Leaf("node-b", "ca", "subjectAltName=DNS:node-b") && Leaf("intruder", "ca", "subjectAltName=DNS:intruder") &&
          Leaf("node-b-elsewhere", "other-ca", "subjectAltName=DNS:node-b", "node-b") &&
          Leaf("node-a-expired", "ca", "subjectAltName=IP:127.0.0.1,DNS:node-a", "node-a", -1);
  }
  ~Certificates() {
    if (!dir_.empty()) std::filesystem::remove_all(dir_);
  }
  bool ok() const { return ok_; }
  // One more certificate of CN `name` from "ca", with `san` ("subjectAltName=IP:127.0.0.2").
  bool Add(const std::string& name, const std::string& san) { return ok_ && Leaf(name, "ca", san); }
  std::string cert(const std::string& name) const { return dir_ + "/" + name + ".pem"; }
  std::string key(const std::string& name) const { return dir_ + "/" + name + ".key"; }
  // A TLS listener with certificate `name` (of "ca") that allows node-b.
  ReplicaListenConfig Listener(const std::string& name) const {
    ReplicaListenConfig config;
    config.tls_cert = cert(name);
    config.tls_key = key(name);
    config.tls_ca = cert("ca");
    config.allow_names = {"node-b"};
    return config;
  }

 private:
  bool Run(const std::string& command) {
    return std::system((command + " >" + dir_ + "/openssl.log 2>&1").c_str()) == 0;
  }
  bool Ca(const std::string& name) {
    return Run("openssl req -x509 -newkey rsa:2048 -nodes -days 2 -subj /CN=" + name + "-root -keyout " + key(name) +
               " -out " + cert(name));
  }
  // `days` -1: a certificate that expired a day ago.
  bool Leaf(const std::string& name, const std::string& ca, const std::string& san, std::string cn = "", int days = 2) {
    if (cn.empty()) cn = name;
    const std::string ext = dir_ + "/" + name + ".ext";
    std::ofstream(ext) << san << "\n";  // the extension file; openssl's output goes to openssl.log
    return std::filesystem::file_size(ext) == san.size() + 1 &&
           Run("openssl req -newkey rsa:2048 -nodes -subj /CN=" + cn + " -keyout " + key(name) + " -out " + dir_ +
               "/" + name + ".csr") &&
           Run("openssl x509 -req -days " + std::to_string(days) + " -in " + dir_ + "/" + name + ".csr -CA " + cert(ca) +
               " -CAkey " + key(ca) +
               " -CAcreateserial -extfile " + ext + " -out " + cert(name));
  }

  std::string dir_;
  bool ok_ = false;
};

}  // namespace flashckpt
