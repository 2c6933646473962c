// gRPC's own messages (handshake failures, transport errors) go to the daemon's log, under the
// logger "grpc", instead of straight to stderr: with --log-file they land in the file beside the
// daemon's lines. A failed TLS handshake is one warning per reason, `tls handshake failed
// reason="..."` (gRPC's own line comes on every connection attempt).
#pragma once

namespace flashckpt {

// Installs the route (gpr_set_log_function). Call once, after the log file is set and before the
// server starts. The severity gRPC prints from stays its own (GRPC_VERBOSITY, default ERROR).
void RouteGrpcLogsToDaemonLog();

}  // namespace flashckpt
