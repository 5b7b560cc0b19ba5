"""Server reflection under both names tools use: grpc.reflection.v1 (newer grpcurl, Postman, grpcui) and v1alpha.

grpcio-reflection ships only v1alpha. The v1 protocol is the same file with the package renamed (same messages,
same field numbers), so one servicer answers both: v1 calls are decoded and encoded with the v1alpha messages, and
a renamed copy of the v1alpha descriptor is added to the pool so that v1 describes itself too.
"""

from __future__ import annotations

from collections.abc import Iterable

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha import reflection
from grpc_reflection.v1alpha import reflection_pb2 as v1alpha

V1ALPHA_SERVICE = reflection.SERVICE_NAME  # "grpc.reflection.v1alpha.ServerReflection"
V1_PACKAGE = "grpc.reflection.v1"
V1_SERVICE = f"{V1_PACKAGE}.ServerReflection"


def _add_v1_descriptor(pool: descriptor_pool.DescriptorPool) -> None:
    """grpc/reflection/v1/reflection.proto, made from the v1alpha file by renaming its package (once per pool)."""
    try:
        pool.FindServiceByName(V1_SERVICE)
        return
    except KeyError:
        pass
    proto = descriptor_pb2.FileDescriptorProto()
    v1alpha.DESCRIPTOR.CopyToProto(proto)
    old, new = f".{v1alpha.DESCRIPTOR.package}.", f".{V1_PACKAGE}."
    proto.name, proto.package = "grpc/reflection/v1/reflection.proto", V1_PACKAGE
    for message in proto.message_type:
        for f in message.field:
            if f.HasField("type_name"):  # scalar fields have none (setting "" would give them one)
                f.type_name = f.type_name.replace(old, new)
    for service in proto.service:
        for m in service.method:
            m.input_type, m.output_type = m.input_type.replace(old, new), m.output_type.replace(old, new)
    pool.Add(proto)


def enable_reflection(service_names: Iterable[str], server: grpc.aio.Server) -> None:
    """Serves reflection v1 and v1alpha on `server`, listing `service_names` plus both reflection services."""
    pool = descriptor_pool.Default()
    _add_v1_descriptor(pool)
    names = (*service_names, V1_SERVICE, V1ALPHA_SERVICE)
    servicer = reflection.aio.ReflectionServicer(names, pool=pool)
    reflection.enable_server_reflection(names, server, pool=pool)  # v1alpha, grpcio-reflection's own registration
    method = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=v1alpha.ServerReflectionRequest.FromString,
        response_serializer=v1alpha.ServerReflectionResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(V1_SERVICE, {"ServerReflectionInfo": method}),)
    )
