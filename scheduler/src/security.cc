#include "moe/scheduler/security.h"

#include <openssl/crypto.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/x509.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "grpcpp/security/server_credentials.h"
#include "moe/core/file.h"
#include "moe/core/status.h"

namespace moe::scheduler {

std::string OpenSslError() {
  const unsigned long code = ERR_get_error();
  ERR_clear_error();
  if (code == 0) return "no detail from OpenSSL";
  char buf[256];
  ERR_error_string_n(code, buf, sizeof(buf));
  return buf;
}

namespace {

// Key files and PEM files are small; a bound keeps a wrong path (a log, a device) from being
// read whole into memory.
constexpr size_t kMaxFileBytes = size_t{1} << 20;

// Reads a regular file of at most kMaxFileBytes (core::ReadBoundedFile: no fifo waits, no
// unbounded reads). `what` names the file's role; as these files are named by flags, every
// failure is kInvalidArgument.
absl::StatusOr<std::string> ReadSmallFile(const std::string& path, absl::string_view what) {
  absl::StatusOr<std::string> text = core::ReadBoundedFile(path, kMaxFileBytes, std::string(what));
  if (text.ok()) return text;
  if (absl::IsNotFound(text.status())) {
    return absl::InvalidArgumentError(absl::StrCat(what, " ", path, ": ", std::strerror(ENOENT)));
  }
  return absl::InvalidArgumentError(absl::StrCat(what, " ", text.status().message()));
}

struct BioFree {
  void operator()(BIO* b) const { BIO_free(b); }
};
struct X509Free {
  void operator()(X509* x) const { X509_free(x); }
};
struct PkeyFree {
  void operator()(EVP_PKEY* k) const { EVP_PKEY_free(k); }
};

// A password callback that has none: an encrypted key fails to load instead of OpenSSL's default
// callback prompting on the terminal of a server.
int NoPassword(char* /*buf*/, int /*size*/, int /*rwflag*/, void* /*u*/) { return 0; }

absl::StatusOr<std::unique_ptr<X509, X509Free>> ParseCertificate(const std::string& pem, const std::string& path,
                                                                 absl::string_view what) {
  std::unique_ptr<BIO, BioFree> bio(BIO_new_mem_buf(pem.data(), static_cast<int>(pem.size())));
  std::unique_ptr<X509, X509Free> cert(PEM_read_bio_X509(bio.get(), nullptr, NoPassword, nullptr));
  if (cert == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " ", path, ": no PEM certificate in it (", OpenSslError(), ")"));
  }
  return cert;
}

absl::StatusOr<std::unique_ptr<EVP_PKEY, PkeyFree>> ParsePrivateKey(const std::string& pem, const std::string& path) {
  std::unique_ptr<BIO, BioFree> bio(BIO_new_mem_buf(pem.data(), static_cast<int>(pem.size())));
  std::unique_ptr<EVP_PKEY, PkeyFree> key(PEM_read_bio_PrivateKey(bio.get(), nullptr, NoPassword, nullptr));
  if (key == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("TLS key file ", path, ": no unencrypted PEM private key in it (",
                                                   OpenSslError(),
                                                   "); decrypt it with `openssl pkey -in KEY -out KEY.plain`"));
  }
  return key;
}

struct TlsPems {
  std::string cert, key, client_ca;
};

// Reads and checks the files; the PEM texts come back for gRPC, which takes contents, not paths.
absl::StatusOr<TlsPems> ReadTlsFiles(const TlsFiles& files) {
  TlsPems pems;
  if (files.cert_file.empty()) {
    if (!files.key_file.empty()) {
      return absl::InvalidArgumentError(absl::StrCat("TLS key file ", files.key_file,
                                                     " given without a certificate file; give both, or neither "
                                                     "for plain TCP"));
    }
    if (!files.client_ca_file.empty()) {
      return absl::InvalidArgumentError(absl::StrCat("TLS client CA file ", files.client_ca_file,
                                                     " given without a server certificate and key; mutual TLS "
                                                     "needs both"));
    }
    return pems;
  }
  if (files.key_file.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("TLS certificate file ", files.cert_file,
                                                   " given without a key file; give both, or neither for plain TCP"));
  }
  MOE_ASSIGN_OR_RETURN(pems.cert, ReadSmallFile(files.cert_file, "TLS certificate file"));
  MOE_ASSIGN_OR_RETURN(pems.key, ReadSmallFile(files.key_file, "TLS key file"));
  MOE_ASSIGN_OR_RETURN(auto cert, ParseCertificate(pems.cert, files.cert_file, "TLS certificate file"));
  MOE_ASSIGN_OR_RETURN(auto key, ParsePrivateKey(pems.key, files.key_file));
  if (X509_check_private_key(cert.get(), key.get()) != 1) {
    ERR_clear_error();
    return absl::InvalidArgumentError(absl::StrCat("TLS key file ", files.key_file,
                                                   " is not the private key of the certificate in ", files.cert_file,
                                                   "; give the key the certificate was issued for"));
  }
  if (!files.client_ca_file.empty()) {
    MOE_ASSIGN_OR_RETURN(pems.client_ca, ReadSmallFile(files.client_ca_file, "TLS client CA file"));
    MOE_RETURN_IF_ERROR(ParseCertificate(pems.client_ca, files.client_ca_file, "TLS client CA file").status());
  }
  return pems;
}

}  // namespace

absl::Status CheckTlsFiles(const TlsFiles& files) { return ReadTlsFiles(files).status(); }

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> GrpcServerCredentials(const TlsFiles& files) {
  MOE_ASSIGN_OR_RETURN(TlsPems pems, ReadTlsFiles(files));
  if (!files.enabled()) return grpc::InsecureServerCredentials();
  grpc::SslServerCredentialsOptions options(files.client_ca_file.empty()
                                                ? GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE
                                                : GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  options.pem_root_certs = pems.client_ca;
  options.pem_key_cert_pairs.push_back({pems.key, pems.cert});
  return grpc::SslServerCredentials(options);
}

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> GrpcClientCredentials(const TlsFiles& files) {
  MOE_ASSIGN_OR_RETURN(TlsPems pems, ReadTlsFiles(files));
  if (!files.enabled()) return grpc::InsecureChannelCredentials();
  grpc::SslCredentialsOptions options;
  options.pem_root_certs = pems.client_ca;
  options.pem_private_key = pems.key;
  options.pem_cert_chain = pems.cert;
  return grpc::SslCredentials(options);
}

ApiKeys::Digest ApiKeys::Sha256(std::string_view text) {
  Digest digest{};
  unsigned int length = 0;
  EVP_Digest(text.data(), text.size(), digest.data(), &length, EVP_sha256(), nullptr);
  return digest;
}

absl::StatusOr<ApiKeys> ApiKeys::Load(const std::string& path) {
  MOE_ASSIGN_OR_RETURN(std::string text, ReadSmallFile(path, "API key file"));
  ApiKeys keys;
  int line_number = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    ++line_number;
    const absl::string_view key = absl::StripAsciiWhitespace(line);
    if (key.empty() || key.front() == '#') continue;
    for (const char c : key) {
      if (absl::ascii_isspace(static_cast<unsigned char>(c)) || absl::ascii_iscntrl(static_cast<unsigned char>(c))) {
        // The key itself stays out of the message: it may be a real one with a typo.
        return absl::InvalidArgumentError(absl::StrCat("API key file ", path, ":", line_number,
                                                       ": the key has whitespace or a control character inside it; "
                                                       "put one key per line"));
      }
    }
    keys.digests_.push_back(Sha256(std::string_view(key.data(), key.size())));
  }
  if (keys.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "API key file ", path, ": no key in it (one key per line; blank lines and # comments are skipped)"));
  }
  return keys;
}

bool ApiKeys::AcceptsAuthorization(std::string_view header_value) const {
  constexpr absl::string_view kScheme = "Bearer ";
  const absl::string_view value(header_value.data(), header_value.size());
  if (value.size() < kScheme.size() || !absl::EqualsIgnoreCase(value.substr(0, kScheme.size()), kScheme)) {
    return false;
  }
  // Comparing digests makes the time independent of the key's length and of where a guess
  // differs; every key is compared so the time does not tell which key (if any) matched.
  const absl::string_view token = absl::StripAsciiWhitespace(value.substr(kScheme.size()));
  const Digest presented = Sha256(std::string_view(token.data(), token.size()));
  int matches = 0;
  for (const Digest& digest : digests_) {
    matches |= CRYPTO_memcmp(presented.data(), digest.data(), digest.size()) == 0;
  }
  return matches != 0 && !digests_.empty();
}

}  // namespace moe::scheduler
