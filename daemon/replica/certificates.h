// Checks of the PEM files given to a TLS flag, made when the flags are read (--check-config and
// start-up): a certificate that cannot work is refused then, with its reason, instead of every
// handshake with it failing later with a bare "Socket closed".
#pragma once

#include <string>

#include "common/base/status.h"

namespace flashckpt {

// The files of one TLS flag group (`flags`: "--replica-tls" or "--tls", for the messages:
// "<flags>-cert", "<flags>-key", "<flags>-ca"). INVALID_ARGUMENT, naming the file and the reason,
// when the certificate does not parse or is not valid now (expired, or not yet valid), when the key
// does not parse or is not the certificate's, or (`ca` not empty) when the CA file holds no
// certificate or none of its certificates signs this one (the file's further certificates are
// taken as its chain).
Status CheckCertificateFiles(const std::string& cert, const std::string& key, const std::string& ca,
                             const std::string& flags);

}  // namespace flashckpt
