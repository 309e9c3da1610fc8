#include "moe/scheduler/security.h"

#include <gmock/gmock.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <chrono>
#include <fstream>
#include <sstream>

#include "moeserve/v1/generation.grpc.pb.h"
#include "test_pki.h"

namespace moe::scheduler {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::Not;

class ApiKeysTest : public ::testing::Test {
 protected:
  std::string Write(const std::string& name, const std::string& text) {
    const std::string path = pki_.Path(name);
    std::ofstream(path) << text;
    return path;
  }
  internal::TestPki pki_;  // only for its scratch directory
};

TEST_F(ApiKeysTest, LoadsKeysSkippingBlankLinesAndComments) {
  auto keys = ApiKeys::Load(Write("keys", "# team keys\n\n  key-one  \n\tkey-two\r\n# key-old\n"));
  ASSERT_TRUE(keys.ok()) << keys.status();
  EXPECT_EQ(keys->size(), 2u);
  EXPECT_TRUE(keys->AcceptsAuthorization("Bearer key-one"));
  EXPECT_TRUE(keys->AcceptsAuthorization("Bearer key-two"));
  EXPECT_TRUE(keys->AcceptsAuthorization("bearer key-two"));
  EXPECT_FALSE(keys->AcceptsAuthorization("Bearer key-old"));
  EXPECT_FALSE(keys->AcceptsAuthorization("Bearer # team keys"));
  EXPECT_FALSE(keys->AcceptsAuthorization("Bearer key-on"));
  EXPECT_FALSE(keys->AcceptsAuthorization("Bearer key-one2"));
  EXPECT_FALSE(keys->AcceptsAuthorization("key-one"));
  EXPECT_FALSE(keys->AcceptsAuthorization("Basic key-one"));
  EXPECT_FALSE(keys->AcceptsAuthorization("Bearer "));
  EXPECT_FALSE(keys->AcceptsAuthorization(""));
}

TEST_F(ApiKeysTest, DefaultAcceptsNothing) {
  ApiKeys keys;
  EXPECT_TRUE(keys.empty());
  EXPECT_FALSE(keys.AcceptsAuthorization("Bearer "));
}

TEST_F(ApiKeysTest, FileWithoutKeysIsAnError) {
  const std::string path = Write("keys", "# nothing yet\n\n   \n");
  auto keys = ApiKeys::Load(path);
  ASSERT_FALSE(keys.ok());
  EXPECT_EQ(keys.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(keys.status().message(), AllOf(HasSubstr(path), HasSubstr("no key in it")));
  EXPECT_FALSE(ApiKeys::Load(Write("empty", "")).ok());
}

TEST_F(ApiKeysTest, MissingFileAndDirectoryNameThePath) {
  const std::string missing = pki_.Path("no-such-keys");
  auto keys = ApiKeys::Load(missing);
  ASSERT_FALSE(keys.ok());
  EXPECT_THAT(keys.status().message(), AllOf(HasSubstr(missing), HasSubstr("No such file")));
  auto dir = ApiKeys::Load(pki_.dir());
  ASSERT_FALSE(dir.ok());
  EXPECT_THAT(dir.status().message(), AllOf(HasSubstr(pki_.dir()), HasSubstr("not a regular file")));
}

TEST_F(ApiKeysTest, KeyWithWhitespaceInsideNamesTheLineNotTheKey) {
  const std::string path = Write("keys", "good-key\nsecret half\n");
  auto keys = ApiKeys::Load(path);
  ASSERT_FALSE(keys.ok());
  EXPECT_THAT(keys.status().message(), AllOf(HasSubstr(path + ":2:"), Not(HasSubstr("secret"))));
}

TEST_F(ApiKeysTest, FileOverOneMebibyteIsRefused) {
  const std::string path = Write("keys", std::string((1 << 20) + 1, 'k'));
  auto keys = ApiKeys::Load(path);
  ASSERT_FALSE(keys.ok());
  EXPECT_THAT(keys.status().message(), AllOf(HasSubstr(path), HasSubstr("more than the 1 MiB")));
}

class TlsFilesTest : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_TRUE(pki_.ok()) << "openssl failed; see " << pki_.Path("openssl.log"); }
  TlsFiles Server() const { return {pki_.Path("server.pem"), pki_.Path("server.key"), ""}; }
  internal::TestPki pki_;
};

TEST_F(TlsFilesTest, AcceptsNoneAndAMatchingPair) {
  EXPECT_TRUE(CheckTlsFiles({}).ok());
  EXPECT_TRUE(CheckTlsFiles(Server()).ok()) << CheckTlsFiles(Server());
  TlsFiles mutual = Server();
  mutual.client_ca_file = pki_.Path("ca.pem");
  EXPECT_TRUE(CheckTlsFiles(mutual).ok()) << CheckTlsFiles(mutual);
}

TEST_F(TlsFilesTest, HalfAPairNamesTheFileGiven) {
  const absl::Status cert_only = CheckTlsFiles({pki_.Path("server.pem"), "", ""});
  EXPECT_EQ(cert_only.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(cert_only.message(), AllOf(HasSubstr(pki_.Path("server.pem")), HasSubstr("without a key file")));
  const absl::Status key_only = CheckTlsFiles({"", pki_.Path("server.key"), ""});
  EXPECT_THAT(key_only.message(), AllOf(HasSubstr(pki_.Path("server.key")), HasSubstr("without a certificate")));
  const absl::Status ca_only = CheckTlsFiles({"", "", pki_.Path("ca.pem")});
  EXPECT_THAT(ca_only.message(), AllOf(HasSubstr(pki_.Path("ca.pem")), HasSubstr("mutual TLS")));
}

TEST_F(TlsFilesTest, KeyOfAnotherCertificateIsRefused) {
  const absl::Status status = CheckTlsFiles({pki_.Path("server.pem"), pki_.Path("client.key"), ""});
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), AllOf(HasSubstr(pki_.Path("client.key")), HasSubstr(pki_.Path("server.pem")),
                                      HasSubstr("is not the private key")));
}

TEST_F(TlsFilesTest, MissingOrNonPemFilesAreNamed) {
  const absl::Status missing = CheckTlsFiles({pki_.Path("nope.pem"), pki_.Path("server.key"), ""});
  EXPECT_THAT(missing.message(), AllOf(HasSubstr(pki_.Path("nope.pem")), HasSubstr("No such file")));
  std::ofstream(pki_.Path("garbage.pem")) << "not a certificate\n";
  TlsFiles bad_ca = Server();
  bad_ca.client_ca_file = pki_.Path("garbage.pem");
  const absl::Status not_pem = CheckTlsFiles(bad_ca);
  EXPECT_THAT(not_pem.message(), AllOf(HasSubstr(pki_.Path("garbage.pem")), HasSubstr("no PEM certificate")));
  const absl::Status key_as_cert = CheckTlsFiles({pki_.Path("server.key"), pki_.Path("server.key"), ""});
  EXPECT_THAT(key_as_cert.message(), HasSubstr("TLS certificate file " + pki_.Path("server.key")));
}

TEST_F(TlsFilesTest, EncryptedKeyFailsWithoutPrompting) {
  ASSERT_TRUE(pki_.Run("openssl pkey -in server.key -aes256 -passout pass:secret -out server-enc.key </dev/null"));
  const absl::Status status = CheckTlsFiles({pki_.Path("server.pem"), pki_.Path("server-enc.key"), ""});
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), AllOf(HasSubstr(pki_.Path("server-enc.key")), HasSubstr("unencrypted")));
}

// A real gRPC server over the credentials, with the Generation service's default methods: a call
// comes back UNIMPLEMENTED once the connection (and its TLS handshake) works, UNAVAILABLE when it
// does not.
class GrpcCredentialsTest : public TlsFilesTest {
 protected:
  void StartServer(const TlsFiles& files) {
    auto credentials = GrpcServerCredentials(files);
    ASSERT_TRUE(credentials.ok()) << credentials.status();
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", *credentials, &port_);
    builder.RegisterService(&service_);
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    ASSERT_NE(port_, 0);
  }
  grpc::StatusCode Call(const std::shared_ptr<grpc::ChannelCredentials>& credentials) {
    auto channel = grpc::CreateChannel("127.0.0.1:" + std::to_string(port_), credentials);
    auto stub = moeserve::v1::Generation::NewStub(channel);
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
    moeserve::v1::GetModelInfoRequest request;
    moeserve::v1::ModelInfo reply;
    return stub->GetModelInfo(&context, request, &reply).error_code();
  }
  std::shared_ptr<grpc::ChannelCredentials> Ssl(const std::string& client) const {
    grpc::SslCredentialsOptions options;
    options.pem_root_certs = Read(pki_.Path("ca.pem"));
    if (!client.empty()) {
      options.pem_private_key = Read(pki_.Path(client + ".key"));
      options.pem_cert_chain = Read(pki_.Path(client + ".pem"));
    }
    return grpc::SslCredentials(options);
  }
  static std::string Read(const std::string& path) {
    std::ifstream in(path);
    std::stringstream text;
    text << in.rdbuf();
    return text.str();
  }
  void TearDown() override {
    if (server_ != nullptr) server_->Shutdown();
  }
  int port_ = 0;
  moeserve::v1::Generation::Service service_;
  std::unique_ptr<grpc::Server> server_;
};

TEST_F(GrpcCredentialsTest, InsecureWithoutCertificate) {
  StartServer({});
  EXPECT_EQ(Call(grpc::InsecureChannelCredentials()), grpc::StatusCode::UNIMPLEMENTED);
}

TEST_F(GrpcCredentialsTest, TlsServesSslClientsOnly) {
  StartServer(Server());
  EXPECT_EQ(Call(Ssl("")), grpc::StatusCode::UNIMPLEMENTED);
  EXPECT_EQ(Call(grpc::InsecureChannelCredentials()), grpc::StatusCode::UNAVAILABLE);
}

TEST_F(GrpcCredentialsTest, MutualTlsRequiresAClientCertificateFromTheCa) {
  TlsFiles mutual = Server();
  mutual.client_ca_file = pki_.Path("ca.pem");
  StartServer(mutual);
  EXPECT_EQ(Call(Ssl("client")), grpc::StatusCode::UNIMPLEMENTED);
  EXPECT_EQ(Call(Ssl("")), grpc::StatusCode::UNAVAILABLE);
  EXPECT_EQ(Call(Ssl("stranger")), grpc::StatusCode::UNAVAILABLE);
}

TEST_F(GrpcCredentialsTest, BadFilesComeBackAsStatus) {
  auto credentials = GrpcServerCredentials({pki_.Path("server.pem"), pki_.Path("client.key"), ""});
  ASSERT_FALSE(credentials.ok());
  EXPECT_THAT(credentials.status().message(), HasSubstr(pki_.Path("client.key")));
}

}  // namespace
}  // namespace moe::scheduler
