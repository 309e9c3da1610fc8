#!/usr/bin/env python3
"""Streams one completion from a moeserve server and prints the tokens as they arrive.

  PYTHONPATH=build/python /usr/bin/python3 examples/stream_client.py --target 127.0.0.1:50051 --prompt-ids 1,2,3

With a server started with --tls-cert/--tls-key, pass --ca-cert (the CA that signed it, and the
name in its certificate as --target, e.g. localhost:50051); with --tls-client-ca also --client-cert
and --client-key; with --api-key-file, --api-key KEY.

The stubs in build/python are generated from proto/moeserve/v1/generation.proto by the build;
python3-grpcio and python3-protobuf come from Debian (scripts/install-deps.sh).
"""
import argparse
import sys

import grpc
from moeserve.v1 import generation_pb2 as pb
from moeserve.v1 import generation_pb2_grpc as rpc


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="127.0.0.1:50051")
    parser.add_argument("--prompt-ids", default="1,2,3,4,5,6,7,8")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--ca-cert", help="PEM CA certificate: connect over TLS")
    parser.add_argument("--client-cert", help="PEM client certificate, for mutual TLS")
    parser.add_argument("--client-key", help="PEM key of --client-cert")
    parser.add_argument("--api-key", help="sent as 'authorization: Bearer KEY'")
    args = parser.parse_args()

    if args.ca_cert:
        def read(path):
            with open(path, "rb") as f:
                return f.read()
        credentials = grpc.ssl_channel_credentials(
            root_certificates=read(args.ca_cert),
            private_key=read(args.client_key) if args.client_key else None,
            certificate_chain=read(args.client_cert) if args.client_cert else None)
        channel = grpc.secure_channel(args.target, credentials)
    else:
        channel = grpc.insecure_channel(args.target)
    metadata = [("authorization", f"Bearer {args.api_key}")] if args.api_key else None
    stub = rpc.GenerationStub(channel)
    try:
        info = stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=metadata, timeout=30)
    except grpc.RpcError as e:
        print(f"error: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    print(f"model: {info.architecture}, vocab {info.vocab_size}, context {info.context_length}, "
          f"experts: {info.placement}")
    request = pb.GenerateRequest(
        token_ids=[int(t) for t in args.prompt_ids.split(",")],
        sampling=pb.SamplingParams(temperature=args.temperature),
        stopping=pb.StoppingParams(max_new_tokens=args.max_new_tokens))
    print("tokens:", end="", flush=True)
    for response in stub.Generate(request, timeout=60, metadata=metadata):
        for token in response.token_ids:
            print(f" {token}", end="", flush=True)
        if response.finish_reason:
            print()
            t = response.timings
            print(f"finished: {pb.FinishReason.Name(response.finish_reason)}, "
                  f"{response.usage.completion_tokens} tokens, first token after "
                  f"{t.first_token_seconds * 1e3:.1f} ms, {t.decode_tokens_per_second:.1f} tokens/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
