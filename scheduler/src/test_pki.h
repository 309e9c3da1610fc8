// Test-only: a scratch directory with a CA, a server certificate for localhost / 127.0.0.1 / ::1
// and client certificates, made with the openssl command-line tool when a test starts, so no key
// is ever committed. The directory is removed when the object goes.
#pragma once

#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "absl/strings/str_cat.h"

namespace moe::scheduler::internal {

class TestPki {
 public:
  TestPki() {
    std::string pattern = (std::filesystem::temp_directory_path() / "moe-pki-XXXXXX").string();
    if (::mkdtemp(pattern.data()) == nullptr) return;
    dir_ = pattern;
    std::ofstream(Path("server.ext")) << "subjectAltName=DNS:localhost,IP:127.0.0.1,IP:::1\n";
    std::ofstream(Path("client.ext")) << "extendedKeyUsage=clientAuth\n";
    ok_ = MakeCa("ca") && MakeCa("other-ca") && MakeLeaf("server", "localhost", "ca", "server.ext") &&
          MakeLeaf("client", "client", "ca", "client.ext") &&
          MakeLeaf("stranger", "stranger", "other-ca", "client.ext");
  }
  ~TestPki() {
    std::error_code ignored;
    if (!dir_.empty()) std::filesystem::remove_all(dir_, ignored);
  }

  bool ok() const { return ok_; }
  const std::string& dir() const { return dir_; }
  std::string Path(const std::string& name) const { return dir_ + "/" + name; }
  // Runs `command` in the directory, its output to openssl.log there; true on exit status 0.
  bool Run(const std::string& command) const {
    return std::system(absl::StrCat("cd '", dir_, "' && (", command, ") >>openssl.log 2>&1").c_str()) == 0;
  }

 private:
  static constexpr const char* kKey = "-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes";
  bool MakeCa(const std::string& name) const {
    return Run(absl::StrCat("openssl req -x509 ", kKey, " -keyout ", name, ".key -out ", name,
                            ".pem -days 2 -subj /CN=moeserve-test-", name));
  }
  bool MakeLeaf(const std::string& name, const std::string& cn, const std::string& ca, const std::string& ext) const {
    return Run(absl::StrCat("openssl req ", kKey, " -keyout ", name, ".key -out ", name, ".csr -subj /CN=", cn)) &&
           Run(absl::StrCat("openssl x509 -req -in ", name, ".csr -CA ", ca, ".pem -CAkey ", ca,
                            ".key -CAcreateserial -days 2 -out ", name, ".pem -extfile ", ext));
  }

  std::string dir_;
  bool ok_ = false;
};

}  // namespace moe::scheduler::internal
