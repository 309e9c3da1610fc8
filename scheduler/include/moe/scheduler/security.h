// Transport security shared by the gRPC server and the HTTP listener: the TLS files both take,
// and the API keys that HTTP requests present as "Authorization: Bearer KEY".
//
// Thread-safety: ApiKeys is immutable after Load; AcceptsAuthorization may run on any number of
// threads at once.
#pragma once

#include <array>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/security/server_credentials.h"

namespace moe::scheduler {

// PEM files. An empty cert_file means plain TCP; client_ca_file set means mutual TLS: every client
// must present a certificate signed by that CA.
struct TlsFiles {
  std::string cert_file;       // server certificate (chain), PEM
  std::string key_file;        // its private key, PEM, not encrypted
  std::string client_ca_file;  // CA certificates that sign client certificates, PEM

  bool enabled() const { return !cert_file.empty(); }
};

// OK when no file is named, or when the files exist, are readable PEM and the key is the
// certificate's. kInvalidArgument naming the file otherwise (a key without a certificate, a
// client CA without a server certificate, a missing or unreadable file, a key that does not match).
absl::Status CheckTlsFiles(const TlsFiles& files);

// Credentials for grpc::ServerBuilder::AddListeningPort from the same files as the HTTP listener:
// insecure without a certificate, TLS with one, and TLS that requires and verifies a client
// certificate when a client CA is given. Errors as CheckTlsFiles.
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> GrpcServerCredentials(const TlsFiles& files);

// The other end, for a client that must present its certificate (mutual TLS between the nodes of
// a deployment): `files`' certificate and key are the client's, client_ca_file the CA that signed
// the servers'. Insecure without a certificate. Errors as CheckTlsFiles.
absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> GrpcClientCredentials(const TlsFiles& files);

// The API keys a server accepts. Only SHA-256 digests of the keys are kept, so a key never
// reaches a log or a core dump in the clear, and every comparison takes the same time whatever
// the key's length or content.
class ApiKeys {
 public:
  ApiKeys() = default;  // accepts nothing; empty()

  // One key per line; blank lines and lines starting with '#' are skipped, as is whitespace around
  // a key. kInvalidArgument naming the file (and line) for a file that cannot be read, is not a
  // regular file, is larger than 1 MiB, holds a key with whitespace inside it, or holds no key.
  // Error messages never contain a key.
  static absl::StatusOr<ApiKeys> Load(const std::string& path);

  bool empty() const { return digests_.empty(); }
  size_t size() const { return digests_.size(); }

  // True when `header_value` is "Bearer KEY" (scheme case-insensitive) for one of the keys. Every
  // key is compared, in constant time, whether or not an earlier one matched.
  bool AcceptsAuthorization(std::string_view header_value) const;

 private:
  using Digest = std::array<unsigned char, 32>;
  static Digest Sha256(std::string_view text);
  std::vector<Digest> digests_;
};

// The oldest queued OpenSSL error as text, and the queue cleared so it cannot leak into the
// next report (for the TLS errors of the gRPC and HTTP servers).
std::string OpenSslError();

}  // namespace moe::scheduler
