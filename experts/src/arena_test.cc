#include "moe/experts/arena.h"

#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace moe::experts {
namespace {

using ::testing::HasSubstr;

std::string SegmentName(const char* what) { return "moeserve_test_" + std::to_string(::getpid()) + "_" + what; }

TEST(HostArenaTest, PrivateArenaIsHugePageAligned) {
  auto arena = HostArena::CreatePrivate(5 << 20);
  ASSERT_TRUE(arena.ok()) << arena.status();
  EXPECT_EQ(reinterpret_cast<uintptr_t>((*arena)->data()) % (2 << 20), 0u);
  EXPECT_FALSE((*arena)->attached());
  EXPECT_FALSE((*arena)->page_kind().empty());
  std::memset((*arena)->data(), 7, 5 << 20);
  EXPECT_EQ((*arena)->data()[(5 << 20) - 1], 7);
}

TEST(HostArenaTest, SecondProcessAttachesToAPublishedSegment) {
  const std::string name = SegmentName("attach");
  ASSERT_TRUE(HostArena::Unlink(name).ok());
  auto owner = HostArena::OpenShared(name, 42, 3 << 20);
  ASSERT_TRUE(owner.ok()) << owner.status();
  EXPECT_FALSE((*owner)->attached());
  EXPECT_EQ(reinterpret_cast<uintptr_t>((*owner)->data()) % (2 << 20), 0u);
  for (int i = 0; i < (3 << 20); i += 4096) (*owner)->data()[i] = static_cast<uint8_t>(i / 4096);
  (*owner)->Publish();

  // A real second process maps it read-only and reads what the first one wrote.
  pid_t child = ::fork();
  if (child == 0) {
    auto other = HostArena::OpenShared(name, 42, 3 << 20);
    if (!other.ok() || !(*other)->attached()) _exit(2);
    for (int i = 0; i < (3 << 20); i += 4096) {
      if ((*other)->data()[i] != static_cast<uint8_t>(i / 4096)) _exit(3);
    }
    _exit(0);
  }
  int status = 0;
  ::waitpid(child, &status, 0);
  EXPECT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0);

  // Another key (the model's files changed): the segment is replaced, never attached; the first
  // owner's mapping keeps the old weights.
  auto other = HostArena::OpenShared(name, 43, 3 << 20);
  ASSERT_TRUE(other.ok()) << other.status();
  EXPECT_FALSE((*other)->attached());
  EXPECT_THAT((*other)->page_kind(), HasSubstr("replacing a segment of other expert weights"));
  EXPECT_EQ((*owner)->data()[4096], 1);
  other->reset();
  owner->reset();
  EXPECT_TRUE(HostArena::Unlink(name).ok());
}

TEST(HostArenaTest, ASegmentInPartsReadsAsOneRegion) {
  // 7 MiB in parts of at least 2 MiB: four parts, NAME, NAME.1 .. NAME.3, mapped end to end.
  const std::string name = SegmentName("parts");
  const size_t bytes = 7 << 20, part = 2 << 20;
  ASSERT_TRUE(HostArena::Unlink(name).ok());
  auto owner = HostArena::OpenShared(name, 9, bytes, part);
  ASSERT_TRUE(owner.ok()) << owner.status();
  EXPECT_THAT((*owner)->page_kind(), HasSubstr("in 4 parts"));
  for (size_t i = 0; i < bytes; i += 512) (*owner)->data()[i] = static_cast<uint8_t>(i / 512 * 7);
  (*owner)->Publish();
  EXPECT_TRUE(std::filesystem::exists("/dev/shm/" + name + ".3"));
  EXPECT_FALSE(std::filesystem::exists("/dev/shm/" + name + ".4"));

  // Another process attaches whatever cut it would have made itself: the first part records it.
  pid_t child = ::fork();
  if (child == 0) {
    auto other = HostArena::OpenShared(name, 9, bytes);
    if (!other.ok() || !(*other)->attached()) _exit(2);
    for (size_t i = 0; i < bytes; i += 512) {
      if ((*other)->data()[i] != static_cast<uint8_t>(i / 512 * 7)) _exit(3);
    }
    _exit(0);
  }
  int status = 0;
  ::waitpid(child, &status, 0);
  EXPECT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0);

  // A part gone: attaching says so and how to clear it.
  ASSERT_TRUE(std::filesystem::remove("/dev/shm/" + name + ".2"));
  auto broken = HostArena::OpenShared(name, 9, bytes, part);
  EXPECT_EQ(broken.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(broken.status().message(), HasSubstr(name + ".2"));
  EXPECT_THAT(broken.status().message(), HasSubstr("remove its parts"));
  owner->reset();
  EXPECT_TRUE(HostArena::Unlink(name).ok());
  for (const char* suffix : {"", ".1", ".3"}) EXPECT_FALSE(std::filesystem::exists("/dev/shm/" + name + suffix));
}

TEST(HostArenaTest, UnpublishedSegmentOfADeadCreatorIsReplaced) {
  const std::string name = SegmentName("stale");
  ASSERT_TRUE(HostArena::Unlink(name).ok());
  pid_t child = ::fork();
  if (child == 0) {
    auto a = HostArena::OpenShared(name, 5, 5 << 20, 2 << 20);  // in parts
    _exit(a.ok() ? 0 : 1);  // dies without publishing
  }
  int status = 0;
  ::waitpid(child, &status, 0);
  ASSERT_EQ(WEXITSTATUS(status), 0);
  auto fresh = HostArena::OpenShared(name, 5, 5 << 20, 2 << 20);
  ASSERT_TRUE(fresh.ok()) << fresh.status();
  EXPECT_FALSE((*fresh)->attached());  // created anew, its parts too, to be filled
  std::memset((*fresh)->data(), 1, 5 << 20);
  fresh->reset();
  EXPECT_TRUE(HostArena::Unlink(name).ok());
  EXPECT_FALSE(std::filesystem::exists("/dev/shm/" + name + ".1"));
}

}  // namespace
}  // namespace moe::experts
