#include "reflection_v1.h"

#include <google/protobuf/descriptor.h>
#include <google/protobuf/descriptor.pb.h>

#include <set>

namespace moe::scheduler::internal {
namespace {

namespace v1 = ::grpc::reflection::v1;
using ::google::protobuf::DescriptorPool;
using ::google::protobuf::FileDescriptor;

// `file` and every file it depends on, each once, as serialized FileDescriptorProtos.
void AddFileAndDependencies(const FileDescriptor* file, std::set<std::string>* seen, v1::FileDescriptorResponse* out) {
  if (file == nullptr || !seen->insert(file->name()).second) return;
  google::protobuf::FileDescriptorProto proto;
  file->CopyTo(&proto);
  out->add_file_descriptor_proto(proto.SerializeAsString());
  for (int i = 0; i < file->dependency_count(); ++i) AddFileAndDependencies(file->dependency(i), seen, out);
}

void NotFound(const std::string& what, v1::ServerReflectionResponse* response) {
  v1::ErrorResponse* error = response->mutable_error_response();
  error->set_error_code(static_cast<int>(::grpc::StatusCode::NOT_FOUND));
  error->set_error_message(what + " not found");
}

void FileResponse(const FileDescriptor* file, const std::string& what, v1::ServerReflectionResponse* response) {
  if (file == nullptr) return NotFound(what, response);
  std::set<std::string> seen;
  AddFileAndDependencies(file, &seen, response->mutable_file_descriptor_response());
}

}  // namespace

::grpc::Status ReflectionV1Service::ServerReflectionInfo(
    ::grpc::ServerContext* context,
    ::grpc::ServerReaderWriter<v1::ServerReflectionResponse, v1::ServerReflectionRequest>* stream) {
  if (authorize_) {
    if (::grpc::Status status = authorize_(*context); !status.ok()) return status;
  }
  const DescriptorPool* pool = DescriptorPool::generated_pool();
  v1::ServerReflectionRequest request;
  while (stream->Read(&request)) {
    v1::ServerReflectionResponse response;
    response.set_valid_host(request.host());
    *response.mutable_original_request() = request;
    switch (request.message_request_case()) {
      case v1::ServerReflectionRequest::kListServices:
        for (const std::string& name : services_)
          response.mutable_list_services_response()->add_service()->set_name(name);
        break;
      case v1::ServerReflectionRequest::kFileByFilename:
        FileResponse(pool->FindFileByName(request.file_by_filename()), "file " + request.file_by_filename(), &response);
        break;
      case v1::ServerReflectionRequest::kFileContainingSymbol:
        FileResponse(pool->FindFileContainingSymbol(request.file_containing_symbol()),
                     "symbol " + request.file_containing_symbol(), &response);
        break;
      case v1::ServerReflectionRequest::kFileContainingExtension: {
        const auto& ext = request.file_containing_extension();
        const auto* type = pool->FindMessageTypeByName(ext.containing_type());
        const auto* field = type != nullptr ? pool->FindExtensionByNumber(type, ext.extension_number()) : nullptr;
        FileResponse(field != nullptr ? field->file() : nullptr,
                     "extension " + std::to_string(ext.extension_number()) + " of " + ext.containing_type(), &response);
        break;
      }
      case v1::ServerReflectionRequest::kAllExtensionNumbersOfType: {
        const auto* type = pool->FindMessageTypeByName(request.all_extension_numbers_of_type());
        if (type == nullptr) {
          NotFound("type " + request.all_extension_numbers_of_type(), &response);
          break;
        }
        std::vector<const google::protobuf::FieldDescriptor*> extensions;
        pool->FindAllExtensions(type, &extensions);
        v1::ExtensionNumberResponse* numbers = response.mutable_all_extension_numbers_response();
        numbers->set_base_type_name(type->full_name());
        for (const auto* e : extensions) numbers->add_extension_number(e->number());
        break;
      }
      default: {
        v1::ErrorResponse* error = response.mutable_error_response();
        error->set_error_code(static_cast<int>(::grpc::StatusCode::UNIMPLEMENTED));
        error->set_error_message("unknown reflection request");
      }
    }
    if (!stream->Write(response)) break;
  }
  return ::grpc::Status::OK;
}

}  // namespace moe::scheduler::internal
