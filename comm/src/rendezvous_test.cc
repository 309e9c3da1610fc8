#include "moe/comm/rendezvous.h"

#include <arpa/inet.h>
#include <sys/socket.h>

#include <cstring>
#include <string>
#include <thread>

#include "gtest/gtest.h"
#include "moe/comm/tcp_socket.h"

namespace moe::comm {
namespace {

constexpr absl::Duration kTestTimeout = absl::Seconds(10);

std::unique_ptr<RendezvousServer> StartServer(RendezvousServerOptions options = {}) {
  auto server = RendezvousServer::Start(options);
  EXPECT_TRUE(server.ok()) << server.status();
  return server.ok() ? *std::move(server) : nullptr;
}

std::unique_ptr<RendezvousClient> Connect(const RendezvousServer& server) {
  auto client = RendezvousClient::Connect(server.address(), kTestTimeout);
  EXPECT_TRUE(client.ok()) << client.status();
  return client.ok() ? *std::move(client) : nullptr;
}

// A request frame written by hand, for clients that misbehave.
std::string Frame(uint32_t magic, uint32_t op, uint32_t timeout_ms, const std::string& key, uint32_t value_len,
                  const std::string& value) {
  std::string out;
  for (uint32_t v : {magic, op, timeout_ms, static_cast<uint32_t>(key.size()), value_len}) {
    const uint32_t be = htonl(v);
    out.append(reinterpret_cast<const char*>(&be), 4);
  }
  return out + key + value;
}

TcpSocket RawConnect(const RendezvousServer& server) {
  auto socket = ConnectTcp("127.0.0.1", server.port(), absl::Now() + kTestTimeout);
  EXPECT_TRUE(socket.ok()) << socket.status();
  return socket.ok() ? *std::move(socket) : TcpSocket();
}

// Reads the server's answer to a refused frame: its code, then the connection closes.
uint32_t ReadRefusal(const TcpSocket& socket, std::string* reason) {
  char header[8];
  EXPECT_TRUE(RecvAll(socket, header, 8, absl::Now() + kTestTimeout, "reply").ok());
  uint32_t code, len;
  std::memcpy(&code, header, 4);
  std::memcpy(&len, header + 4, 4);
  reason->resize(ntohl(len));
  EXPECT_TRUE(RecvAll(socket, reason->data(), reason->size(), absl::Now() + kTestTimeout, "reason").ok());
  char byte;
  EXPECT_EQ(RecvAll(socket, &byte, 1, absl::Now() + kTestTimeout, "end").code(), absl::StatusCode::kUnavailable)
      << "the server keeps a connection it cannot trust";
  return ntohl(code);
}

TEST(RendezvousTest, SetGetAndWait) {
  auto server = StartServer();
  ASSERT_NE(server, nullptr);
  EXPECT_GT(server->port(), 0);
  auto client = Connect(*server);
  ASSERT_NE(client, nullptr);
  ASSERT_TRUE(client->Set("group/0", std::string("\0addr", 5)).ok());
  auto value = client->Get("group/0", kTestTimeout);
  ASSERT_TRUE(value.ok()) << value.status();
  EXPECT_EQ(*value, std::string("\0addr", 5));
  ASSERT_TRUE(client->Set("group/0", "").ok());  // overwrites, with an empty value
  EXPECT_EQ(*client->Get("group/0", kTestTimeout), "");
  EXPECT_TRUE(client->Wait({"group/0"}, kTestTimeout).ok());
}

TEST(RendezvousTest, GetWaitsForALaterSet) {
  auto server = StartServer();
  ASSERT_NE(server, nullptr);
  auto reader = Connect(*server);
  auto writer = Connect(*server);
  ASSERT_TRUE(reader && writer);
  std::thread later([&] {
    absl::SleepFor(absl::Milliseconds(100));
    EXPECT_TRUE(writer->Set("late", "here").ok());
  });
  auto value = reader->Get("late", kTestTimeout);
  later.join();
  ASSERT_TRUE(value.ok()) << value.status();
  EXPECT_EQ(*value, "here");
}

TEST(RendezvousTest, GetOfAMissingKeyTimesOut) {
  auto server = StartServer();
  ASSERT_NE(server, nullptr);
  auto client = Connect(*server);
  ASSERT_NE(client, nullptr);
  auto value = client->Get("nobody/sets/this", absl::Milliseconds(200));
  EXPECT_EQ(value.status().code(), absl::StatusCode::kDeadlineExceeded) << value.status();
  EXPECT_NE(value.status().message().find("nobody/sets/this"), std::string::npos) << value.status();
  EXPECT_EQ(client->Wait({"nobody/sets/this"}, absl::Milliseconds(50)).code(), absl::StatusCode::kDeadlineExceeded);
  // The connection stays good.
  ASSERT_TRUE(client->Set("k", "v").ok());
  EXPECT_EQ(*client->Get("k", kTestTimeout), "v");
}

TEST(RendezvousTest, OversizeKeysAndValuesAreRefusedBeforeSending) {
  auto server = StartServer();
  ASSERT_NE(server, nullptr);
  auto client = Connect(*server);
  ASSERT_NE(client, nullptr);
  const absl::Status big_value = client->Set("k", std::string(kMaxValueBytes + 1, 'x'));
  EXPECT_EQ(big_value.code(), absl::StatusCode::kInvalidArgument) << big_value;
  EXPECT_NE(big_value.message().find("limit"), std::string::npos) << big_value;
  EXPECT_EQ(client->Set(std::string(kMaxKeyBytes + 1, 'k'), "v").code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(client->Get("", kTestTimeout).status().code(), absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(client->Set("k", std::string(kMaxValueBytes, 'y')).ok());  // the limit itself is fine
  EXPECT_EQ(client->Get("k", kTestTimeout)->size(), static_cast<size_t>(kMaxValueBytes));
}

TEST(RendezvousTest, BadFramesOnlyCloseTheirOwnConnection) {
  auto server = StartServer();
  ASSERT_NE(server, nullptr);
  auto good = Connect(*server);
  ASSERT_NE(good, nullptr);
  ASSERT_TRUE(good->Set("before", "1").ok());
  // A waiter that must still be answered after the bad clients have come and gone.
  auto waiter = Connect(*server);
  ASSERT_NE(waiter, nullptr);
  absl::StatusOr<std::string> waited;
  std::thread wait([&] { waited = waiter->Get("after", kTestTimeout); });

  std::string reason;
  {
    TcpSocket raw = RawConnect(*server);
    const std::string http = "GET / HTTP/1.1\r\nHost: x\r\n\r\n";
    ASSERT_TRUE(SendAll(raw, http.data(), http.size(), absl::Now() + kTestTimeout, "junk").ok());
    EXPECT_EQ(ReadRefusal(raw, &reason), 2u);
    EXPECT_NE(reason.find("magic"), std::string::npos) << reason;
  }
  {
    TcpSocket raw = RawConnect(*server);  // a header announcing a 1 GiB value, and no value
    const std::string frame = Frame(kRendezvousMagic, 1, 0, "k", 1u << 30, "");
    ASSERT_TRUE(SendAll(raw, frame.data(), frame.size(), absl::Now() + kTestTimeout, "frame").ok());
    EXPECT_EQ(ReadRefusal(raw, &reason), 3u);
    EXPECT_NE(reason.find("1073741824"), std::string::npos) << reason;
  }
  {
    TcpSocket raw = RawConnect(*server);
    const std::string frame = Frame(kRendezvousMagic, 99, 0, "k", 0, "");
    ASSERT_TRUE(SendAll(raw, frame.data(), frame.size(), absl::Now() + kTestTimeout, "frame").ok());
    EXPECT_EQ(ReadRefusal(raw, &reason), 2u);
    EXPECT_NE(reason.find("unknown op 99"), std::string::npos) << reason;
  }
  ASSERT_TRUE(good->Set("after", "2").ok());
  wait.join();
  ASSERT_TRUE(waited.ok()) << waited.status();
  EXPECT_EQ(*waited, "2");
  EXPECT_EQ(*good->Get("before", kTestTimeout), "1");
}

TEST(RendezvousTest, ClientsThatLeaveMidFrameOrMidWaitDoNotBreakOthers) {
  auto server = StartServer();
  ASSERT_NE(server, nullptr);
  {
    TcpSocket raw = RawConnect(*server);  // half a header
    const std::string frame = Frame(kRendezvousMagic, 1, 0, "key", 1000, std::string(1000, 'v'));
    ASSERT_TRUE(SendAll(raw, frame.data(), 7, absl::Now() + kTestTimeout, "frame").ok());
  }
  {
    TcpSocket raw = RawConnect(*server);  // a whole header and a tenth of the value
    const std::string frame = Frame(kRendezvousMagic, 1, 0, "key", 1000, std::string(1000, 'v'));
    ASSERT_TRUE(SendAll(raw, frame.data(), 20 + 3 + 100, absl::Now() + kTestTimeout, "frame").ok());
  }
  {
    TcpSocket raw = RawConnect(*server);  // a GET that waits, then the client goes
    const std::string frame = Frame(kRendezvousMagic, 2, 10000, "key", 0, "");
    ASSERT_TRUE(SendAll(raw, frame.data(), frame.size(), absl::Now() + kTestTimeout, "frame").ok());
    absl::SleepFor(absl::Milliseconds(50));
  }
  auto client = Connect(*server);
  ASSERT_NE(client, nullptr);
  ASSERT_TRUE(client->Set("key", "whole").ok());  // the half-sent SET never happened
  EXPECT_EQ(*client->Get("key", kTestTimeout), "whole");
}

TEST(RendezvousTest, AFullStoreRefusesTheSetAndKeepsServing) {
  RendezvousServerOptions options;
  options.max_store_bytes = 100;
  auto server = StartServer(options);
  ASSERT_NE(server, nullptr);
  auto client = Connect(*server);
  ASSERT_NE(client, nullptr);
  ASSERT_TRUE(client->Set("small", "1").ok());
  const absl::Status full = client->Set("big", std::string(200, 'x'));
  EXPECT_EQ(full.code(), absl::StatusCode::kResourceExhausted) << full;
  EXPECT_EQ(*client->Get("small", kTestTimeout), "1");
}

TEST(RendezvousTest, StopAnswersWaitingClientsWithUnavailable) {
  auto server = StartServer();
  ASSERT_NE(server, nullptr);
  auto client = Connect(*server);
  ASSERT_NE(client, nullptr);
  absl::StatusOr<std::string> waited;
  std::thread wait([&] { waited = client->Get("never", absl::Seconds(30)); });
  absl::SleepFor(absl::Milliseconds(100));
  server->Stop();
  wait.join();
  EXPECT_EQ(waited.status().code(), absl::StatusCode::kUnavailable) << waited.status();
  server->Stop();  // idempotent
}

TEST(RendezvousTest, BadAddressesAreClearErrors) {
  EXPECT_EQ(RendezvousClient::Connect("127.0.0.1", absl::Seconds(1)).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(RendezvousClient::Connect("127.0.0.1:99999", absl::Seconds(1)).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(RendezvousClient::Connect("::1:5000", absl::Seconds(1)).status().code(),
            absl::StatusCode::kInvalidArgument);
  // Nobody listens on the port of a stopped server: refused until the timeout.
  int port = 0;
  {
    auto server = StartServer();
    ASSERT_NE(server, nullptr);
    port = server->port();
  }
  const auto refused = RendezvousClient::Connect(FormatHostPort("127.0.0.1", port), absl::Milliseconds(300));
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kDeadlineExceeded) << refused.status();
}

}  // namespace
}  // namespace moe::comm

namespace moe::comm {
namespace {

// A store with a secret serves only connections that AUTH with it: a client without it (or with
// another) and a raw frame without AUTH are refused with UNAUTHENTICATED; the right one works.
TEST(RendezvousTest, AStoreWithASecretServesOnlyClientsThatHoldIt) {
  RendezvousServerOptions options;
  options.secret = "0123456789abcdef0123456789abcdef";
  auto server = StartServer(options);
  ASSERT_NE(server, nullptr);
  auto good = RendezvousClient::Connect(server->address(), kTestTimeout, options.secret);
  ASSERT_TRUE(good.ok()) << good.status();
  ASSERT_TRUE((*good)->Set("moe/gen1/0", "address").ok());

  auto none = RendezvousClient::Connect(server->address(), kTestTimeout);
  ASSERT_TRUE(none.ok()) << none.status();  // no secret: nothing to send until a request
  const auto read = (*none)->Get("moe/gen1/0", absl::Milliseconds(100));
  EXPECT_EQ(read.status().code(), absl::StatusCode::kUnauthenticated) << read.status();
  EXPECT_NE(read.status().message().find("control-plane secret"), std::string::npos) << read.status();
  EXPECT_EQ((*none)->Set("moe/gen1/0", "forged").code(), absl::StatusCode::kUnauthenticated);

  auto wrong = RendezvousClient::Connect(server->address(), kTestTimeout, "not the secret at all");
  EXPECT_EQ(wrong.status().code(), absl::StatusCode::kUnauthenticated) << wrong.status();

  TcpSocket raw = RawConnect(*server);
  const std::string get = Frame(kRendezvousMagic, 2, 0, "moe/gen1/0", 0, "");
  ASSERT_TRUE(SendAll(raw, get.data(), get.size(), absl::Now() + kTestTimeout, "frame").ok());
  std::string reason;
  EXPECT_EQ(ReadRefusal(raw, &reason), 5u) << reason;

  // Nothing forged got in.
  EXPECT_EQ(*(*good)->Get("moe/gen1/0", kTestTimeout), "address");
}

// An old generation's keys are dropped; the next generation's stay.
TEST(RendezvousTest, DropKeysRemovesAnOldGenerationsKeys) {
  auto server = StartServer();
  ASSERT_NE(server, nullptr);
  auto client = Connect(*server);
  ASSERT_NE(client, nullptr);
  ASSERT_TRUE(client->Set("moe/gen1/0", "old").ok());
  ASSERT_TRUE(client->Set("moe/gen10/0", "new").ok());
  server->DropKeys("moe/gen1/");
  // The drop happens at the loop's next turn: a GET after it finds nothing.
  absl::StatusOr<std::string> gone = std::string("old");
  for (int i = 0; i < 100 && gone.ok(); ++i) gone = client->Get("moe/gen1/0", absl::ZeroDuration());
  EXPECT_EQ(gone.status().code(), absl::StatusCode::kDeadlineExceeded) << gone.status();
  EXPECT_EQ(*client->Get("moe/gen10/0", kTestTimeout), "new");
}

}  // namespace
}  // namespace moe::comm
