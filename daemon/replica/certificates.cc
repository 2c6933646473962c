#include "daemon/replica/certificates.h"

#include <openssl/bio.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/x509.h>
#include <openssl/x509_vfy.h>

#include <memory>
#include <vector>

#include "common/io/net.h"

namespace flashckpt {
namespace {

struct FreeBio {
  void operator()(BIO* b) const { BIO_free(b); }
};
struct FreeX509 {
  void operator()(X509* x) const { X509_free(x); }
};
struct FreeKey {
  void operator()(EVP_PKEY* k) const { EVP_PKEY_free(k); }
};
struct FreeStore {
  void operator()(X509_STORE* s) const { X509_STORE_free(s); }
};
struct FreeStoreCtx {
  void operator()(X509_STORE_CTX* c) const { X509_STORE_CTX_free(c); }
};
struct FreeStack {
  void operator()(STACK_OF(X509) * s) const { sk_X509_free(s); }
};
using X509Ptr = std::unique_ptr<X509, FreeX509>;

// The first error OpenSSL queued (and the queue emptied): what a message can say of a parse failure.
std::string OpensslError() {
  const unsigned long code = ERR_get_error();
  ERR_clear_error();
  if (code == 0) return "no detail from OpenSSL";
  char text[256];
  ERR_error_string_n(code, text, sizeof text);
  return text;
}

std::string TimeText(const ASN1_TIME* t) {
  std::unique_ptr<BIO, FreeBio> bio(BIO_new(BIO_s_mem()));
  if (!bio || ASN1_TIME_print(bio.get(), t) != 1) return "(an unreadable time)";
  char* data = nullptr;
  const long n = BIO_get_mem_data(bio.get(), &data);
  return n > 0 ? std::string(data, static_cast<size_t>(n)) : "(an unreadable time)";
}

// Every certificate of a PEM text, in order (none when the first does not parse).
std::vector<X509Ptr> Certificates(const std::string& pem) {
  std::vector<X509Ptr> out;
  std::unique_ptr<BIO, FreeBio> bio(BIO_new_mem_buf(pem.data(), static_cast<int>(pem.size())));
  if (!bio) return out;
  while (X509* x = PEM_read_bio_X509(bio.get(), nullptr, nullptr, nullptr)) out.emplace_back(x);
  return out;
}

}  // namespace

Status CheckCertificateFiles(const std::string& cert, const std::string& key, const std::string& ca,
                             const std::string& flags) {
  const std::string cert_flag = flags + "-cert", key_flag = flags + "-key", ca_flag = flags + "-ca";
  ASSIGN_OR_RETURN(std::string cert_pem,
                   ReadPem(cert, cert_flag.c_str(), "-----BEGIN CERTIFICATE-----", "certificate"));
  ASSIGN_OR_RETURN(std::string key_pem, ReadPem(key, key_flag.c_str(), "PRIVATE KEY-----", "private key"));
  ERR_clear_error();
  std::vector<X509Ptr> chain = Certificates(cert_pem);
  if (chain.empty()) {
    return InvalidArgument(cert_flag + " " + cert + ": its certificate does not parse (" + OpensslError() + ")");
  }
  ERR_clear_error();  // the end of the file, after the last certificate
  X509* leaf = chain.front().get();
  if (X509_cmp_current_time(X509_get0_notBefore(leaf)) >= 0) {
    return InvalidArgument(cert_flag + " " + cert + " is not valid yet: not before " +
                           TimeText(X509_get0_notBefore(leaf)) + " (is this host's clock right?)");
  }
  if (X509_cmp_current_time(X509_get0_notAfter(leaf)) <= 0) {
    return InvalidArgument(cert_flag + " " + cert + " expired on " + TimeText(X509_get0_notAfter(leaf)) +
                           ": every TLS handshake with it would fail");
  }
  std::unique_ptr<BIO, FreeBio> key_bio(BIO_new_mem_buf(key_pem.data(), static_cast<int>(key_pem.size())));
  std::unique_ptr<EVP_PKEY, FreeKey> pkey(
      key_bio ? PEM_read_bio_PrivateKey(key_bio.get(), nullptr, nullptr, nullptr) : nullptr);
  if (!pkey) {
    return InvalidArgument(key_flag + " " + key + ": its private key does not parse (an encrypted key is not " +
                           "supported) (" + OpensslError() + ")");
  }
  if (X509_check_private_key(leaf, pkey.get()) != 1) {
    ERR_clear_error();
    return InvalidArgument(key_flag + " " + key + " is not the key of the certificate in " + cert_flag + " " + cert);
  }
  if (ca.empty()) return Status::OK();
  ASSIGN_OR_RETURN(std::string ca_pem, ReadPem(ca, ca_flag.c_str(), "-----BEGIN CERTIFICATE-----", "CA certificate"));
  std::vector<X509Ptr> roots = Certificates(ca_pem);
  if (roots.empty()) {
    return InvalidArgument(ca_flag + " " + ca + ": its certificate does not parse (" + OpensslError() + ")");
  }
  ERR_clear_error();
  std::unique_ptr<X509_STORE, FreeStore> store(X509_STORE_new());
  std::unique_ptr<STACK_OF(X509), FreeStack> untrusted(sk_X509_new_null());
  std::unique_ptr<X509_STORE_CTX, FreeStoreCtx> ctx(X509_STORE_CTX_new());
  if (!store || !untrusted || !ctx) return Internal("OpenSSL could not allocate a certificate store");
  for (const X509Ptr& root : roots) {
    if (X509_STORE_add_cert(store.get(), root.get()) != 1) ERR_clear_error();  // a duplicate: harmless
  }
  for (size_t i = 1; i < chain.size(); ++i) sk_X509_push(untrusted.get(), chain[i].get());
  if (X509_STORE_CTX_init(ctx.get(), store.get(), leaf, untrusted.get()) != 1) {
    return Internal("OpenSSL could not set up a certificate check: " + OpensslError());
  }
  if (X509_verify_cert(ctx.get()) != 1) {
    const int error = X509_STORE_CTX_get_error(ctx.get());
    ERR_clear_error();
    return InvalidArgument(cert_flag + " " + cert + " is not signed by the CA in " + ca_flag + " " + ca + " (" +
                           X509_verify_cert_error_string(error) + "): peers that trust that CA would refuse it");
  }
  return Status::OK();
}

}  // namespace flashckpt
