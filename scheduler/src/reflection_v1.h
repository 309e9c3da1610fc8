// grpc.reflection.v1.ServerReflection over the descriptors linked into this binary, beside the
// v1alpha service that gRPC 1.51 provides: clients that ask for v1 first (grpcurl, Postman) list
// and describe the services without falling back.
//
// Thread-safety: the service is immutable after construction; gRPC calls it from any thread.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "grpc/reflection/v1/reflection.grpc.pb.h"

namespace moe::scheduler::internal {

class ReflectionV1Service final : public ::grpc::reflection::v1::ServerReflection::Service {
 public:
  using Authorize = std::function<::grpc::Status(const ::grpc::ServerContext&)>;
  // `services`: the full names listed by list_services. `authorize`, when set, is asked first
  // (the API keys): a call it refuses gets its status and nothing else.
  explicit ReflectionV1Service(std::vector<std::string> services, Authorize authorize = nullptr)
      : services_(std::move(services)), authorize_(std::move(authorize)) {}

  ::grpc::Status ServerReflectionInfo(
      ::grpc::ServerContext* context,
      ::grpc::ServerReaderWriter<::grpc::reflection::v1::ServerReflectionResponse,
                                 ::grpc::reflection::v1::ServerReflectionRequest>* stream) override;

 private:
  const std::vector<std::string> services_;
  const Authorize authorize_;
};

}  // namespace moe::scheduler::internal
