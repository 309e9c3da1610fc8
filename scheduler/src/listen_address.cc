#include "moe/scheduler/listen_address.h"

#include <arpa/inet.h>

#include <algorithm>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace moe::scheduler {

absl::StatusOr<ListenAddress> ParseListenAddress(const std::string& listen) {
  const auto bad = [&](absl::string_view why) {
    return absl::InvalidArgumentError(absl::StrCat("listen address '", listen, "': ", why));
  };
  std::string host;
  absl::string_view port_text;
  const absl::string_view text = listen;
  if (!text.empty() && text.front() == '[') {
    const size_t close = text.find(']');
    if (close == absl::string_view::npos || close + 1 >= text.size() || text[close + 1] != ':') {
      return bad("expected [IPV6]:PORT, as in [::1]:9090");
    }
    host = std::string(text.substr(1, close - 1));
    port_text = text.substr(close + 2);
    in6_addr v6{};
    if (inet_pton(AF_INET6, host.c_str(), &v6) != 1) {
      return bad(absl::StrCat("'", host, "' is not an IPv6 address"));
    }
  } else {
    const size_t colon = text.rfind(':');
    if (colon == absl::string_view::npos) return bad("expected HOST:PORT, as in 127.0.0.1:9090");
    host = std::string(text.substr(0, colon));
    port_text = text.substr(colon + 1);
    if (host.find(':') != std::string::npos) return bad("an IPv6 address goes in brackets, as in [::1]:9090");
    if (host == "localhost") host = "127.0.0.1";
    in_addr v4{};
    if (inet_pton(AF_INET, host.c_str(), &v4) != 1) {
      return bad(absl::StrCat("host '", host, "' is not an IPv4 address, an [IPv6] address or localhost"));
    }
  }
  int64_t port = -1;
  const bool digits = !port_text.empty() && port_text.size() <= 10 &&
                      std::all_of(port_text.begin(), port_text.end(), absl::ascii_isdigit);
  if (!digits || !absl::SimpleAtoi(port_text, &port)) {
    return bad(absl::StrCat("port '", port_text, "' is not a number"));
  }
  if (port > 65535) return bad(absl::StrCat("port ", port, " is out of range 0..65535"));
  return ListenAddress{host, static_cast<int>(port)};
}

}  // namespace moe::scheduler
